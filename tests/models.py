"""Tiny random models written in Hugging Face format: the fixtures' weights and the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random model of ``kind`` (llama | qwen2 | qwen3 | llama31 | mistral, and the
    mixtures of experts mixtral | qwen2_moe | qwen3_moe) to ``folder``. qwen3's heads are wider
    than hidden / heads (its q is 2x the hidden size, as in Qwen3-0.6B). The experts: 8 of
    them, 2 per token (mixtral: 4); qwen3_moe renormalises the top 2 with layer 1 dense
    (``mlp_only_layers``); qwen2_moe has a shared expert and does not renormalise."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    params = {**TINY_BASE, **overrides}
    torch.manual_seed(seed)
    if kind == "qwen2":
        model: Any = Qwen2ForCausalLM(Qwen2Config(**params, tie_word_embeddings=True))
    elif kind == "qwen3":
        config = Qwen3Config(**{"head_dim": 32, **params}, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(config)
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**params, num_local_experts=4))
    elif kind == "qwen2_moe":
        moe: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(**params, **moe, shared_expert_intermediate_size=64)
        )
    elif kind == "qwen3_moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **{"head_dim": 32, **params}, **moe, norm_topk_prob=True, mlp_only_layers=[1]
            )
        )
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**params, sliding_window=None))
    elif kind == "llama31":
        params["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        params["rope_theta"] = 500000.0
        model = LlamaForCausalLM(LlamaConfig(**params))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**params))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        # Random init has tiny variance; widen it so attention is far from uniform.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 1:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, params["vocab_size"])
    return folder


def set_chat_template(folder: Path, template: str) -> Path:
    """Replace the chat template of a tiny model's tokenizer (e.g. ``QWEN_TOOLS``)."""
    import json

    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return folder


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2.5's template (tools in the system turn, <tool_call> JSON, tool results as
# <tool_response> in a user turn), as Qwen2.5-Instruct's tokenizer_config.json has it.
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    'tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    '</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    '{{- \'", "arguments": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    '{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    '{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}'
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello mesh!",
    "Serving language models fast needs batching, paging and caching of keys and values.",
    "你好，世界。今天天气很好。我们一起学习。",
    "Emoji: 🙂 🚀 🎉 and accents: café, naïve, Zürich.",
    "def main():\n    return 42\n",
]


def write_tiny_tokenizer(
    folder: Path, vocab_size: int = 512, chat_template: str = CHATML, added: tuple[str, ...] = ()
) -> None:
    """A byte-level BPE (every UTF-8 string encodes) with ChatML specials at ids 0, 1, 2;
    ``added``: tokens of one id each that decode as text (not special), as Qwen3's
    ``<think>`` and ``</think>``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens(list(added))
    # pad to the model's vocabulary so every id the model can emit decodes (to nothing)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": chat_template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_tiny_lora(
    folder: Path,
    base: Path,
    targets: tuple[str, ...] = LORA_PROJECTIONS,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    **config: Any,
) -> Path:
    """A PEFT LoRA adapter for the tiny model in ``base``, as ``peft`` saves one, with random
    A and B (peft starts B at zero; a test needs an update that changes something)."""
    import json

    from safetensors.torch import save_file

    hf = json.loads((base / "config.json").read_text())
    h, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or h // heads
    inter = hf["intermediate_size"]
    shapes = {
        "q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h),
        "o_proj": (h, heads * d), "gate_proj": (inter, h), "up_proj": (inter, h),
        "down_proj": (h, inter),
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(hf["num_hidden_layers"]):
        for proj in targets:
            out, inp = shapes[proj]
            block = "self_attn" if proj in LORA_PROJECTIONS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "base_model_name_or_path": str(base), **config,
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def merged_hf_model(base: Path, adapter: Path) -> Any:
    """transformers' model of ``base`` with ``adapter`` merged into its weights: the oracle of
    a LoRA request (W + scale * B @ A, scale = alpha / r, or / sqrt(r) with rsLoRA)."""
    import json
    import math

    from safetensors.torch import load_file

    model = hf_model(base)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            r = a.shape[0]
            scale = settings["lora_alpha"] / (math.sqrt(r) if settings.get("use_rslora") else r)
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[target].add_(scale * (b @ a))
    return model
