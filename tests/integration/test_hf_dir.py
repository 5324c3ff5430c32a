"""The real loading path: a local Hugging Face directory (config, safetensors, tokenizer, image
processor files), generated here with the tiny flavor's weights."""

import json

import pytest
from safetensors.torch import save_file

from oracle import recipe as recipes
from oracle.bundle.store import Bundle
from oracle.capture.steps import capture_recipe_step
from oracle.errors import RecipeError
from oracle.score.scorer import score
from oracle_replays.qwen3_vl import flavors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source):
    d = tmp_path_factory.mktemp("Qwen3-VL-tiny")
    model = source.recipe.build(source.config)
    model.config.save_pretrained(d)
    # sharded checkpoint with an index, as real 8B checkpoints are
    names = sorted(source.weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, ns in shards.items():
        save_file({n: source.weights[n].contiguous() for n in ns}, str(d / fname))
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    flavors.tiny_tokenizer().save_pretrained(d)
    flavors.tiny_image_processor().save_pretrained(d)
    return d


def test_local_directory_capture_is_the_same_step_as_the_embedded_model(hf_dir, fp32_capture, oracle_bundle, tmp_path):
    r = recipes.for_model(str(hf_dir))
    assert r.name == "qwen3-vl"
    src = r.load(str(hf_dir))
    cap = capture_recipe_step(src, r.default_sample(), str(tmp_path / "from-dir"))
    assert Bundle(cap).get("loss")["value"] == Bundle(fp32_capture).get("loss")["value"]
    res = score(oracle_bundle, [cap])  # fingerprints match: same inputs, same weights
    assert max(p["rel_l2"] for p in res["captures"][0]["params"]) < 1e-4


def test_directory_problems_are_named(tmp_path, hf_dir):
    with pytest.raises(RecipeError, match="no config.json"):
        recipes.for_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(RecipeError, match="no recipe handles model_type 'llama'"):
        recipes.for_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(RecipeError, match="no model.safetensors"):
        recipes.for_model(str(tmp_path)).load(str(tmp_path))
