"""The KV cache in blocks: the block pool (ref counts, prefix hashes) and the preallocated tensors."""
