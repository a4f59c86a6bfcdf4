"""One role per module: actor, critic, reference, reward. Each takes a `Batch` and returns
tensors or metrics; micro-batching lives here, not in the trainer loop."""
