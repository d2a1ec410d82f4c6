"""The model side of the engine: attention over KV blocks, the runner, captured decode steps."""
