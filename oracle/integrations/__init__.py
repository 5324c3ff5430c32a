"""Other tools' formats: Megatron (capture hook, merge, layouts, names, rank view), msprobe dumps,
grad-norm logs. May import score and everything below it."""
