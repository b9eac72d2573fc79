"""Train kvscope's bundled demo model: a tiny Gemma 3 (text) that speaks King James English.

The corpus is the King James Version of the Bible (public domain) from Debian's `bible-kjv-text`
package, read through that package's `bible` program (package `bible-kjv`, which the text package
pulls in). This script installs nothing; on Debian or Ubuntu:

    apt-get install bible-kjv-text && python tools/train_demo_model.py

Steps (all seeded, so a rerun on the same corpus and torch version repeats the run up to the
non-determinism of multi-threaded float sums):
1. Corpus: one document per chapter ("Genesis 1", a blank line, one verse per line, no verse
   numbers). Every 50th chapter (chapter index % 50 == 25) is held out for validation.
2. Tokenizer: a byte-level BPE (`tokenizers`, GPT-2 split regex) with 4096 tokens trained on the
   training chapters; special tokens <pad> = 0, <eos> = 1, <bos> = 2 (Gemma's ids).
3. Model: gemma3 text, 6 layers (layers 0-4 slide with window 64, layer 5 is global), 4 query heads,
   1 KV head, head size 64, n_embd 256, n_ff 1024, tied embeddings, context length 1024. It is
   trained with the engine's own forward pass (engine/models/transformer.py `Transformer.forward_train`
   with engine/models/full_sequence.py), rebuilt each step from leaf tensors under Hugging Face names
   (Gemma norms held as llama.cpp's stored value 1 + w).
4. Training: sequences of 256 tokens cut at random offsets from the packed token stream
   (<bos> chapter <eos> <bos> chapter ...), AdamW, linear warm-up then cosine decay to 10 %,
   gradient clipping at 1.0, fp32, 2 threads. A time limit (--max-minutes) stops training early
   if the machine is slower than planned; the schedule is by step, so size --steps with --trial.
5. Export: a Hugging Face Gemma3ForCausalLM folder (work dir), then the GGUF with
   engine.testing.tiny_models.write_gguf_from_hf (F16 weights, F32 norms), then held-out loss and
   sample continuations through the engine (engine.Context + engine.runners.generate.Generator), written to
   <work dir>/report.json.

Usage:
    python tools/train_demo_model.py --trial-seconds 60      # measure tokens/s, train nothing
    python tools/train_demo_model.py                        # train (1600 steps), export, report
    python tools/train_demo_model.py --export-only           # export the last checkpoint again
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.kv.swa import SwaType  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.full_sequence import FullSequenceAttention  # noqa: E402
from engine.models.transformer import Transformer  # noqa: E402

MODEL_NAME = "kvscope-demo-gemma3"
SPECIALS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 as in Gemma
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
HOLDOUT_EVERY, HOLDOUT_AT = 50, 25

ARCH = dict(vocab_size=4096, n_embd=256, n_layer=6, n_head=4, n_head_kv=1, head_dim=64, n_ff=1024,
            sliding_window=64, n_ctx_train=1024, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            rope_theta_swa=10_000.0)


# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer


def read_kjv() -> list[str]:
    """Every chapter of the KJV as one document, from Debian's bible-kjv(-text) `bible` program."""
    if shutil.which("bible") is None:
        sys.exit("the `bible` program is missing: apt-get install bible-kjv-text (it pulls in bible-kjv)")
    out = subprocess.run(["bible", "-l", "100000", "-m", "8192", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    chapters: list[tuple[str, list[str]]] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):  # "Genesis 1"
            chapters.append((line.strip(), []))
            continue
        number, _, verse = line.strip().partition(" ")
        if not number.isdigit() or not chapters:
            raise ValueError(f"unexpected line in bible output: {line!r}")
        chapters[-1][1].append(verse.strip())
    docs = [title + "\n\n" + "\n".join(verses) for title, verses in chapters]
    if len(docs) != 1189:
        raise ValueError(f"expected the 1189 chapters of the KJV, got {len(docs)}")
    return docs


def split_docs(docs: list[str]) -> tuple[list[str], list[str]]:
    train = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY != HOLDOUT_AT]
    val = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY == HOLDOUT_AT]
    return train, val


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [PAD_ID, EOS_ID, BOS_ID]
    return tok


def pack(tok, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [BOS_ID] + enc.ids + [EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Model


def model_config(vocab_size: int) -> ModelConfig:
    a = ARCH
    return ModelConfig(
        arch="gemma3", n_vocab=vocab_size, n_embd=a["n_embd"], n_layer=a["n_layer"], n_head=a["n_head"],
        n_head_kv=a["n_head_kv"], head_dim=a["head_dim"], n_ff=a["n_ff"], rms_norm_eps=a["rms_norm_eps"],
        rope_theta=a["rope_theta"], n_ctx_train=a["n_ctx_train"], tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), add_bos=True, name=MODEL_NAME,
        n_swa=a["sliding_window"], swa_type=int(SwaType.STANDARD),
        swa_layers=tuple(il % 6 < 5 for il in range(a["n_layer"])), rope_theta_swa=a["rope_theta_swa"],
        query_pre_attn_scalar=float(a["head_dim"]), hidden_act="gelu_tanh")


def init_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named leaf tensors; matrices N(0, 0.02), Gemma norms at their stored value 1 + 0."""
    from engine.models.load import expected_tensor_shapes

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(expected_tensor_shapes(config).items()):
        if len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t /= math.sqrt(2 * config.n_layer)
        weights[name] = t.requires_grad_(True)
    return weights


def loss_on(config: ModelConfig, weights: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of batch [B, T + 1] through the engine's forward pass."""
    B, T1 = batch.shape
    T = T1 - 1
    model = Transformer(config, weights, torch.float32)
    attn = FullSequenceAttention(config, n_groups=B, n_tokens=T)
    tokens = batch[:, :-1].reshape(-1)
    logits = model.forward_train(tokens, attn.positions(), attn, torch.arange(B * T))
    return F.cross_entropy(logits, batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(config: ModelConfig, weights: dict[str, torch.Tensor], stream: torch.Tensor, seq: int,
             max_windows: int | None = None, batch: int = 8) -> float:
    """Mean loss over non-overlapping windows of the held-out stream."""
    n = (len(stream) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    windows = torch.stack([stream[i * seq: i * seq + seq + 1] for i in range(n)])
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        total += loss_on(config, weights, chunk).item() * len(chunk)
    return total / n


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------
# Export


def hf_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Leaves -> HF Gemma3ForCausalLM tensors: norms back from 1 + w to w."""
    out = {}
    for name, t in weights.items():
        t = t.detach().clone().float()
        out[name] = t - 1.0 if name.endswith("norm.weight") else t
    return out


def write_hf_folder(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tok) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    a = ARCH
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], vocab_size=config.n_vocab, hidden_size=a["n_embd"],
        intermediate_size=a["n_ff"], num_hidden_layers=a["n_layer"], num_attention_heads=a["n_head"],
        num_key_value_heads=a["n_head_kv"], head_dim=a["head_dim"], max_position_embeddings=a["n_ctx_train"],
        rms_norm_eps=a["rms_norm_eps"], tie_word_embeddings=True, query_pre_attn_scalar=a["head_dim"],
        sliding_window=a["sliding_window"], hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention" if il % 6 < 5 else "full_attention" for il in range(a["n_layer"])],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": a["rope_theta_swa"]},
                         "full_attention": {"rope_type": "default", "rope_theta": a["rope_theta"]}},
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, final_logit_softcapping=None)
    model = Gemma3ForCausalLM(hf_config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(weights), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"HF export: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": a["n_ctx_train"]}, indent=2) + "\n")
    return folder


PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "The king of Israel", "Blessed are the"]


def engine_samples(gguf_path: Path, n_predict: int = 48) -> list[dict]:
    import engine
    from engine.runners.generate import Generator
    from engine.sampling import SamplerParams

    model = engine.load_model(gguf_path)
    samples = []
    for i, prompt in enumerate(PROMPTS):
        for kind, params in (("greedy", SamplerParams(temperature=0.0)),
                             ("sampled", SamplerParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234 + i))):
            ctx = engine.Context(model)
            text = Generator(ctx, params).generate(prompt, n_predict).text
            samples.append({"prompt": prompt, "kind": kind, "text": text})
            print(f"[{kind}] {prompt!r} -> {text!r}", flush=True)
    return samples


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=45.0, help="stop training after this much wall time")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--trial-seconds", type=float, default=0.0, help="only measure tokens/s for this long")
    ap.add_argument("--work-dir", type=Path, default=REPO / "build" / "demo-train")
    ap.add_argument("--out", type=Path, default=REPO / "engine" / "models" / "demo" / f"{MODEL_NAME}.gguf")
    ap.add_argument("--resume", action="store_true", help="continue from <work dir>/checkpoint.pt")
    ap.add_argument("--export-only", action="store_true", help="export <work dir>/checkpoint.pt, no training")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    train_docs, val_docs = split_docs(read_kjv())
    tok = train_tokenizer(train_docs, ARCH["vocab_size"])
    train_stream, val_stream = pack(tok, train_docs), pack(tok, val_docs)
    print(f"corpus: {len(train_docs)} training chapters ({len(train_stream)} tokens), {len(val_docs)} held out "
          f"({len(val_stream)} tokens); tokenizer {tok.get_vocab_size()} tokens, {time.time() - t0:.1f} s", flush=True)

    config = model_config(tok.get_vocab_size())
    weights = init_weights(config, args.seed)
    n_params = sum(t.numel() for t in weights.values())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    decay = [t for n, t in weights.items() if t.ndim == 2]
    no_decay = [t for n, t in weights.items() if t.ndim == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt_path = work / "checkpoint.pt"
    step, history, train_seconds = 0, [], 0.0
    if args.resume or args.export_only:
        ckpt = torch.load(ckpt_path)
        with torch.no_grad():
            for n, t in weights.items():
                t.copy_(ckpt["weights"][n])
        opt.load_state_dict(ckpt["opt"])
        step, history, train_seconds = ckpt["step"], ckpt["history"], ckpt["train_seconds"]
        if args.export_only:  # report the settings the checkpoint was trained with
            for key in ("batch", "seq", "lr", "warmup", "weight_decay", "steps"):
                setattr(args, key, ckpt["args"][key])
        print(f"resumed from {ckpt_path} at step {step}", flush=True)

    def save() -> None:
        torch.save({"weights": {n: t.detach() for n, t in weights.items()}, "opt": opt.state_dict(), "step": step,
                    "history": history, "train_seconds": train_seconds, "args": vars(args) | {
                        "work_dir": str(args.work_dir), "out": str(args.out)}}, ckpt_path)

    g = torch.Generator().manual_seed(args.seed + 1)
    n_start = len(train_stream) - args.seq - 1
    stopped_early = False
    if not args.export_only:
        t_start = time.time() - train_seconds
        t_log, tok_log = time.time(), 0
        limit = args.trial_seconds if args.trial_seconds else args.max_minutes * 60
        while step < args.steps:
            starts = torch.randint(0, n_start, (args.batch,), generator=g)
            batch = torch.stack([train_stream[s: s + args.seq + 1] for s in starts])
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = loss_on(config, weights, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(list(weights.values()), 1.0).item()
            opt.step()
            step += 1
            tok_log += args.batch * args.seq
            train_seconds = time.time() - t_start
            if step % 10 == 0 or step == 1:
                now = time.time()
                tps = tok_log / (now - t_log)
                t_log, tok_log = now, 0
                history.append({"step": step, "loss": round(loss.item(), 4), "lr": lr, "tok_s": round(tps, 1),
                                "elapsed_s": round(train_seconds, 1)})
                print(f"step {step}/{args.steps} loss {loss.item():.4f} lr {lr:.2e} |g| {gnorm:.2f} "
                      f"{tps:.0f} tok/s {train_seconds / 60:.1f} min", flush=True)
            if args.eval_every and step % args.eval_every == 0 and not args.trial_seconds:
                val = evaluate(config, weights, val_stream, args.seq, max_windows=32)
                history.append({"step": step, "val_loss_32": round(val, 4)})
                print(f"step {step}: held-out loss (32 windows) {val:.4f}", flush=True)
                save()
            if train_seconds > limit:
                stopped_early = not args.trial_seconds
                break
        if args.trial_seconds:
            tokens = step * args.batch * args.seq
            tps = tokens / train_seconds
            budget = args.max_minutes * 60 * 0.92  # room for evaluations and checkpoints
            print(f"trial: {step} steps, {tokens} tokens in {train_seconds:.0f} s = {tps:.0f} tok/s; "
                  f"{args.max_minutes:.0f} min fit about {int(budget * tps / (args.batch * args.seq))} steps", flush=True)
            return
        save()
        print(f"training: {step} steps, {train_seconds / 60:.1f} min" + (" (stopped by the time limit)" if stopped_early else ""),
              flush=True)

    val_loss = evaluate(config, weights, val_stream, args.seq)
    n_val_tokens = ((len(val_stream) - 1) // args.seq) * args.seq
    print(f"held-out loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f} over {n_val_tokens} tokens", flush=True)

    from engine.testing.tiny_models import write_gguf_from_hf

    hf = write_hf_folder(work / MODEL_NAME, config, weights, tok)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_from_hf(hf, args.out, tensor_type="F16")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", flush=True)
    samples = engine_samples(args.out)
    report = {
        "n_params": n_params, "steps": step, "planned_steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
        "warmup": args.warmup, "weight_decay": args.weight_decay, "train_seconds": round(train_seconds, 1),
        "stopped_by_time_limit": stopped_early, "train_tokens_seen": step * args.batch * args.seq,
        "train_stream_tokens": len(train_stream), "val_tokens": n_val_tokens, "val_loss": round(val_loss, 4),
        "val_perplexity": round(math.exp(val_loss), 2), "gguf_bytes": args.out.stat().st_size,
        "history": history, "samples": samples, "torch": torch.__version__,
    }
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {work / 'report.json'}", flush=True)


if __name__ == "__main__":
    main()
