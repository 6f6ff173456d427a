"""A plain torch forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) with a
per-slot KV cache, for the embedded rollout engine.

Why not `model.forward()` with a transformers cache: a continuous batch adds and removes rows
every few steps. transformers' caches either share one write index across rows (StaticCache)
or cost about one decode step per row removed or inserted (DynamicCache), and its call overhead
is ~2x a plain forward on CPU (see shared/MEASURED.md). Here every slot owns a row of the cache:
removing a sequence is free and adding one costs only its own prefill.

The weights are the model's own tensors, copied once and addressed by their Hugging Face names,
so a weight update is a `copy_` per tensor. Tests check the logits against the model's
`forward()` (fp32, within 1e-4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class KVCache:
    """keys/values: [layers, slots, kv_heads, max_len, head_dim]. Active sequences occupy
    slots 0..n-1 (kept compact), so a decode step reads a plain slice."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, device, dtype):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def move(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def swap(self, a: int, b: int, len_a: int, len_b: int) -> None:
        for t in (self.k, self.v):
            tmp = t[:, a, :, :len_a].clone()
            t[:, a, :, :len_b] = t[:, b, :, :len_b]
            t[:, b, :, :len_a] = tmp

    def release(self) -> None:
        self.k = self.v = None  # type: ignore[assignment]


class Decoder:
    def __init__(self, model, device: torch.device, dtype: torch.dtype):
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"the embedded engine supports {', '.join(SUPPORTED)} models; "
                             f"this one is {cfg.model_type!r}")
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type == "qwen3"
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(device=device, dtype=torch.float32).clone()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.w = {name: t.detach().to(device=device, dtype=dtype).clone()
                  for name, t in model.state_dict().items() if not name.endswith("inv_freq")}
        self.tied = "lm_head.weight" not in self.w or getattr(cfg, "tie_word_embeddings", False)

    @torch.no_grad()
    def load(self, named_tensors) -> None:
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        for name, t in items:
            if name in self.w:
                self.w[name].copy_(t.detach())

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(self.n_layers, slots, self.n_kv, max_len, self.head_dim,
                       self.device, self.dtype)

    # --- building blocks ---------------------------------------------------------------------
    def _norm(self, x, weight):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _linear(self, x, prefix):
        b = self.w.get(prefix + ".bias")
        return F.linear(x, self.w[prefix + ".weight"], b)

    def _rope(self, x, pos):
        """x: [..., T, head_dim], pos: broadcastable [.., T] positions."""
        freqs = pos.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)
        sin = (emb.sin() * self.rope_scale).to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _qkv(self, h, i, pos):
        """h: [B, T, d] -> q [B, H, T, D], k, v [B, Hkv, T, D] with RoPE applied."""
        B, T, _ = h.shape
        p = f"model.layers.{i}.self_attn."
        q = self._linear(h, p + "q_proj").view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self._linear(h, p + "k_proj").view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self._linear(h, p + "v_proj").view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q = self._norm(q, self.w[p + "q_norm.weight"])
            k = self._norm(k, self.w[p + "k_norm.weight"])
        pos = pos.unsqueeze(1)  # [B, 1, T]
        return self._rope(q, pos), self._rope(k, pos), v

    def _mlp(self, x, i):
        p = f"model.layers.{i}.mlp."
        return self._linear(F.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"),
                            p + "down_proj")

    def _logits(self, x):
        x = self._norm(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight"] if self.tied else self.w["lm_head.weight"]
        return F.linear(x, head)

    # --- prefill and decode --------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cache: KVCache, slots: list[int], rows: list[list[int]]) -> None:
        """Write the KV entries of `rows` (right-padded into one batch) into `slots`."""
        B, T = len(rows), max(len(r) for r in rows)
        ids = torch.zeros((B, T), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.arange(T, device=self.device).expand(B, T)
        x = self.w["model.embed_tokens.weight"][ids]
        slot_idx = torch.tensor(slots, device=self.device)
        group = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, self.w[p + "input_layernorm.weight"])
            q, k, v = self._qkv(h, i, pos)
            # right padding: each real query only sees earlier (real) keys under a causal mask
            cache.k[i, slot_idx, :, :T] = k
            cache.v[i, slot_idx, :, :T] = v
            kk = k.repeat_interleave(group, dim=1)
            vv = v.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            a = a.transpose(1, 2).reshape(B, T, -1)
            x = x + self._linear(a, p + "self_attn.o_proj")
            x = x + self._mlp(self._norm(x, self.w[p + "post_attention_layernorm.weight"]), i)

    @torch.no_grad()
    def decode(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of the first B slots. tokens: [B]; lengths: [B] cached entries per
        slot (the new token's position). Returns logits [B, vocab] in float32."""
        B = tokens.shape[0]
        T = int(lengths.max().item()) + 1
        x = self.w["model.embed_tokens.weight"][tokens].unsqueeze(1)  # [B, 1, d]
        pos = lengths.unsqueeze(1)  # [B, 1]
        group = self.n_heads // self.n_kv
        rows = torch.arange(B, device=self.device)
        # keys at positions > a row's own length are other (older) data: mask them
        mask = torch.arange(T, device=self.device).unsqueeze(0) > lengths.unsqueeze(1)  # [B, T]
        mask = mask.view(B, 1, 1, T)
        scale = self.head_dim ** -0.5
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, self.w[p + "input_layernorm.weight"])
            q, k, v = self._qkv(h, i, pos)
            cache.k[i, rows, :, lengths] = k[:, :, 0]
            cache.v[i, rows, :, lengths] = v[:, :, 0]
            K = cache.k[i, :B, :, :T]  # [B, Hkv, T, D]
            V = cache.v[i, :B, :, :T]
            qg = q.view(B, self.n_kv, group, self.head_dim)  # one query token
            s = torch.matmul(qg, K.transpose(-1, -2)) * scale  # [B, Hkv, G, T]
            s = s.float().masked_fill(mask, float("-inf"))
            a = torch.matmul(torch.softmax(s, dim=-1).to(V.dtype), V)  # [B, Hkv, G, D]
            a = a.reshape(B, 1, self.n_heads * self.head_dim)
            x = x + self._linear(a, p + "self_attn.o_proj")
            x = x + self._mlp(self._norm(x, self.w[p + "post_attention_layernorm.weight"]), i)
        return self._logits(x[:, 0]).float()
