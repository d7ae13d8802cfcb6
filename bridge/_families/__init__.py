"""Model families: what a family of Hugging Face models names and packs its weights as
(Qwen2-MoE's and Mixtral's experts), as data, below every layer that reads or writes
them."""
