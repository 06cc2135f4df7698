"""The BDH model, knowing nothing of DeepSpeed or of the rest of dragon.

- bdh: BDHConfig, BDHForCausalLM (a Hugging Face causal LM), BDHLayer, fired_rows
- attention: the three exact attention forms (quadratic, chunked, recurrent) and BDHCache
- convert: the reference implementation's weights <-> BDHForCausalLM
- cost: parameters and FLOPs per token of each attention form (ModelProfile, model_profile)
- sparsity: how many of the sparse activations fire (SparsityProbe)
- remote_code: an export's model code beside its weights (loads without dragon)
- baseline: transformers' GPT-2 or Llama, sized to compare with a BDH (--model_type)
"""
