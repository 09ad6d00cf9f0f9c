"""The engine: loading a drafter/target pair, the target's precision and cost profile, the decoders, the
throughput rule that picks each round's draft, model-free drafts and recorded decodes."""
