"""The on-disk step: the bundle store (atomic publish, strict JSON, the manifest schema), a Hugging Face
weights directory, and shape checks. Imports only the root (errors, recipe registry)."""
