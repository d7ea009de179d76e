"""EAGLE-3 and EAGLE 3.1 speculative decoding for Hugging Face transformers.

Importing this package registers the drafter with `AutoConfig` / `AutoModel`, lets `AutoModel` load
EAGLE heads saved by other projects (`modeling.route_auto_classes`), and routes
`generate(assistant_model=<EAGLE drafter>)` to EAGLE decoding (see `hf_eagle31.generation`).
"""

# first: an untested transformers is refused by name before anything else meets it
from hf_eagle31 import compat  # noqa: F401

from transformers import AutoConfig, AutoModel

from hf_eagle31.configuration import Eagle3Config
from hf_eagle31.generation import drafting_dtype, fast_decoding, install
from hf_eagle31.modeling import Eagle3DraftModel, route_auto_classes
from hf_eagle31.backends.cpu.products import hold_products, packed_weights  # packed_weights: the old name
from hf_eagle31.stats import SpeculationStats

AutoConfig.register(Eagle3Config.model_type, Eagle3Config)
AutoModel.register(Eagle3Config, Eagle3DraftModel)
route_auto_classes()
install()

__version__ = "0.1.0"
__all__ = ["Eagle3Config", "Eagle3DraftModel", "SpeculationStats", "drafting_dtype", "fast_decoding", "hold_products"]
