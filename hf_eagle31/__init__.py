"""EAGLE-3 and EAGLE 3.1 speculative decoding for Hugging Face transformers.

Importing this package registers the drafter with `AutoConfig` / `AutoModel`.
"""

from transformers import AutoConfig, AutoModel

from hf_eagle31.configuration import Eagle3Config
from hf_eagle31.modeling import Eagle3DraftModel

AutoConfig.register(Eagle3Config.model_type, Eagle3Config)
AutoModel.register(Eagle3Config, Eagle3DraftModel)

__version__ = "0.1.0"
__all__ = ["Eagle3Config", "Eagle3DraftModel"]
