"""The streamed replay: materialise and evict units, spill activations, the resume journal,
and the plan (``--dry-run``). Part of replay; imports what replay may."""
