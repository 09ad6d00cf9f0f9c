"""OmniDraft Fleet: one universal drafter that speeds up any target model.

Sub-packages (mapped from the repository's top-level folders):
  omnidraft.shared       the engine: model catalog, vocabulary bridge, n-gram cache, decoding
  omnidraft.client       device side
  omnidraft.coordinator  coordinator side (Flower ServerApp)
  omnidraft.proto        protobuf wire formats
"""

__version__ = "0.1.0"
