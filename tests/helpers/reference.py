"""The ground truth every method is compared with: transformers' own greedy decoding (and seeded sampling);
random prompts; a byte-level tokenizer with a chat template.

    want = hf_greedy(tiny_hf, [3, 4, 5], 16)              # the 16 token ids generate(do_sample=False) gives
"""
from __future__ import annotations

import torch

from common.sampling import Sampling, gumbel


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_sample(model, prompt: list[int], n: int, s: Sampling) -> list[int]:
    """Plain sampling from the target (transformers' forward and warpers) with the same seeded noise."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = TemperatureLogitsWarper(s.temperature)(None, model(torch.tensor([seq])).logits[:, -1].float())
            x = TopPLogitsWarper(s.top_p)(None, TopKLogitsWarper(s.top_k)(None, x) if s.top_k else x)
            seq.append(int((torch.log_softmax(x, -1)[0] + gumbel(s.seed, [len(seq)], x.shape[-1])[0]).argmax()))
    return seq[len(prompt):]


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer whose token id is the byte value (fits the tiny model's 256 ids), with a chat
    template; built offline with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    visible = [*range(33, 127), *range(161, 173), *range(174, 256)]        # GPT-2's byte -> character map
    chars = {b: chr(b) for b in visible}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TEMPLATE)
