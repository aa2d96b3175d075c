"""hyla: hybrid linear-attention language models (GLA + softmax attention), PyTorch-native."""

__version__ = "0.1.0"
