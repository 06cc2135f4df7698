"""dragon: training recipes for the BDH language model on DeepSpeed."""

from transformers import AutoConfig, AutoModelForCausalLM

from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.model.cost import ModelProfile, model_profile
from dragon.version import __version__

AutoConfig.register("bdh", BDHConfig, exist_ok=True)
AutoModelForCausalLM.register(BDHConfig, BDHForCausalLM, exist_ok=True)

__all__ = ["BDHConfig", "BDHForCausalLM", "ModelProfile", "model_profile", "__version__"]
