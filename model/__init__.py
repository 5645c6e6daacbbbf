"""A hand-written LLaMA decoder with its own KV cache. Knows nothing of speculation."""

from model.config import ConfigError, ModelConfig
from model.model import Llama

__all__ = ["ConfigError", "Llama", "ModelConfig"]
