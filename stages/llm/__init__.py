"""The language stage: paged KV blocks, sampling, scheduling and the model runner (DESIGN §6)."""
