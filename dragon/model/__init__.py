"""The BDH model, knowing nothing of DeepSpeed or of the rest of dragon.

- bdh: BDHConfig, BDHForCausalLM (a Hugging Face causal LM), BDHLayer, fired_rows
- attention: the three exact attention forms (quadratic, chunked, recurrent) and BDHCache
- convert: the reference implementation's weights <-> BDHForCausalLM
- cost: parameters and FLOPs per token of each attention form (ModelProfile, model_profile)
"""
