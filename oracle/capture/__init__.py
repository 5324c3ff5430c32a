"""Taking a step: the Capture API, the module-boundary recorder, samples, packing, and building a
recipe's model for a capture step. Imports bundle and the root."""
