"""Model families: what a family of Hugging Face models names and packs its weights as
(`_experts.py`: Qwen2-MoE's and Mixtral's experts; `_gpt2.py`: GPT-2's `Conv1D`
names; `_offset_norms.py`: the norms computing `x * (1 + weight)`), as data, below
every layer that reads or writes them."""
