"""Tiny, seeded, random-weight chat LMs (Llama, Qwen2) with an in-process byte-level BPE tokenizer.

Saved with `save_pretrained` (model + tokenizer + chat template) so they reload through the real
`AutoModelForCausalLM` / `AutoTokenizer` path offline. Outputs are noise; the code path is real.
"""

from __future__ import annotations

import torch

# ChatML: the template the demo models carry (transformers renders it with apply_chat_template).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A fixed corpus so the trained merges (and so every token id) are the same on every machine.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A serving engine batches requests, pages its key-value cache and streams tokens back to clients.",
    "Images, video and speech are decoded, encoded and cached; prompts are tokenized and prefilled.",
    "user assistant system: hello, how are you? I am fine, thank you! Numbers 0123456789.",
    "Émoji 🙂 and 漢字 and ümlauts test the byte-level fallback of the tokenizer.",
]
SIZES = {  # scale -> (hidden, layers, heads, kv heads, intermediate)
    "tiny": (64, 2, 4, 2, 128),
    "small": (256, 4, 8, 4, 688),
}


class Checkpoint:
    """A model and its tokenizer or processor, saved together in one folder like a hub checkpoint."""

    def __init__(self, model, processor):
        self.model = model
        self.processor = processor  # a tokenizer, or a processor that holds one

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def chat_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_chat_model(arch: str, seed: int, scale: str) -> Checkpoint:
    """arch "llama" or "qwen2"; scale "tiny" (tests, demo) or "small" (benchmarks)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = chat_tokenizer()
    hidden, layers, heads, kv_heads, inter = SIZES[scale]
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                  max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = (LlamaForCausalLM(config) if isinstance(config, LlamaConfig) else Qwen2ForCausalLM(config)).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return Checkpoint(model, tokenizer)
