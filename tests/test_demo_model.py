"""The bundled demo model (engine/models/demo/kvscope-demo-gemma3.gguf, trained by
tools/train_demo_model.py): it loads by the name "demo", its logits match transformers on an HF export
of its own tensors, greedy generation is deterministic English, and its iSWA cache has llama.cpp's
sizes. Nothing here retrains it."""
from __future__ import annotations

import re

import pytest
import torch

import engine
from engine.batch import Batch
from engine.errors import ModelFileError
from engine.kv.iswa import swa_cache_size
from engine.models import model as model_module
from engine.models.load import read_checkpoint
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

DEMO = model_module.DEMO_MODEL_PATH
GREEDY = SamplerParams(temperature=0.0)
WINDOW = 64
# Common words of English (and of the King James Version the model was trained on).
ENGLISH_WORDS = set("""
a all also and are as at be before behold but by came come day did do down earth for from go god
had hand hath have he heart her him his house i in into is israel it king land let lord made man me
men my not now o of on one out people said saith say saying shall she so son sons that the thee their
them then there these they thing things this thou thus thy to unto up upon us was we went were what
when which who will with word words ye you your heaven light waters father mother children name
""".split())

pytestmark = pytest.mark.skipif(not DEMO.is_file(), reason=f"{DEMO} is not built")


@pytest.fixture(scope="module")
def demo() -> engine.Model:
    return engine.load_model("demo")


def test_demo_loads_by_name_with_its_config(demo):
    cfg = demo.config
    assert demo.path == str(DEMO) and demo.file_format == "gguf"
    assert cfg.arch == "gemma3" and cfg.n_layer == 6
    assert cfg.swa_layers == (True, True, True, True, True, False)
    assert cfg.n_swa == WINDOW and cfg.swa_type == 1
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (256, 4, 1, 64)
    assert cfg.n_vocab == 4096 and demo.tokenizer is not None
    assert cfg.n_ctx_train == 1024 and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rope_theta_swa) == (1e6, 10000.0)
    assert cfg.bos_token_id == 2 and 1 in cfg.eos_token_ids
    assert 5e6 <= demo.transformer.n_params() <= 15e6
    assert DEMO.stat().st_size <= 25e6
    types = set(demo.tensor_types.values())
    assert types <= {"F16", "F32"} and demo.tensor_types["model.norm.weight"] == "F32"


def test_missing_demo_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(model_module, "DEMO_MODEL_PATH", tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError, match="demo model is missing"):
        engine.load_model("demo")


def _export_hf(folder, ckpt) -> None:
    """The GGUF's tensors as a transformers Gemma3ForCausalLM folder (norms back from 1 + w to w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = ckpt.config
    hf_config = Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv,
        head_dim=c.head_dim, max_position_embeddings=c.n_ctx_train, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=True, query_pre_attn_scalar=int(c.query_pre_attn_scalar), sliding_window=c.n_swa,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        layer_types=["sliding_attention" if c.is_swa(il) else "full_attention" for il in range(c.n_layer)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta_swa},
                         "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta}},
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids[0], pad_token_id=0)
    model = Gemma3ForCausalLM(hf_config).to(torch.float32)
    state = {n: (t - 1.0 if n.endswith("norm.weight") else t) for n, t in ckpt.tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.save_pretrained(folder)


def test_logits_match_transformers_past_the_window(demo, tmp_path):
    from transformers import AutoModelForCausalLM

    _export_hf(tmp_path / "demo-hf", read_checkpoint(DEMO))
    text = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
            "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the "
            "waters. And God said, Let there be light: and there was light. And God saw the light, that it "
            "was good: and God divided the light from the darkness. And God called the light Day, and the "
            "darkness he called Night. And the evening and the morning were the first day. And God said, Let "
            "there be a firmament in the midst of the waters, and let it divide the waters from the waters. "
            "And God made the firmament, and divided the waters which were under the firmament from the "
            "waters which were above the firmament: and it was so. And God called the firmament Heaven.")
    tokens = demo.tokenizer.encode(text)  # with <bos>
    assert len(tokens) > 2 * WINDOW
    # small ubatches and a small SWA cache: the sliding layers' cells are reused while decoding
    ctx = engine.Context(demo, n_ctx=256, n_ubatch=32, n_batch=32, pad=32, type_k="f32", type_v="f32")
    assert ctx.memory.swa.size < len(tokens)
    got = []
    for start in range(0, len(tokens), 32):
        chunk = tokens[start:start + 32]
        assert ctx.decode(Batch(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk),
                                [True] * len(chunk))) == 0, ctx.last_error
        got += [ctx.logits(i).clone() for i in range(len(chunk))]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "demo-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    err = (torch.stack(got) - ref).abs().max().item()
    assert err < 1e-4, err
    assert ref.abs().max().item() > 1.0  # real, peaked logits, not a degenerate comparison


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_greedy_generation_is_deterministic_english(demo):
    prompt = "And God said unto"
    first = Generator(engine.Context(demo), GREEDY).generate(prompt, 40).text
    second = Generator(engine.Context(demo), GREEDY).generate(prompt, 40).text
    assert first == second
    words = _words(first)
    known = [w for w in words if w in ENGLISH_WORDS]
    assert len(set(known)) >= 5, first
    assert len(known) >= 0.4 * len(words), first


@pytest.mark.parametrize("n_ctx, n_ubatch, base, swa", [(512, 512, 512, 512), (4096, 512, 4096, 768),
                                                          (1024, 128, 1024, 256)])
def test_iswa_cache_sizes(demo, n_ctx, n_ubatch, base, swa):
    kw = {} if n_ctx == 512 and n_ubatch == 512 else {"n_ctx": n_ctx, "n_ubatch": n_ubatch, "n_batch": n_ubatch}
    ctx = engine.Context(demo, **kw)  # the first case is engine.Context(model)'s defaults
    expected = swa_cache_size(n_ctx, WINDOW, unified=False, n_seq_max=1, n_ubatch=n_ubatch, pad=256, swa_full=False)
    assert expected == swa
    assert ctx.memory.base.size == base
    assert ctx.memory.swa.size == swa


def test_cli_without_model_runs_the_demo(capsys):
    from engine.cli import main

    rc = main(["generate", "-p", "And the LORD said", "-n", "12", "--temp", "0", "-c", "512"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("And the LORD said") and len(_words(out)) > 4
    assert "gemma3" in err
