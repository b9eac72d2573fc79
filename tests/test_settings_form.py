"""The settings fields both explorers show: text in, settings out, a bad field named in the error."""
from __future__ import annotations

import pytest

from engine.runners.session import Session
from engine.watch.settings_form import SETTINGS, estimate_lines, parse_settings, shown


def test_fields_parse_to_settings_and_blank_fields_are_left_alone():
    fields = {"n_ctx": " 512 ", "kv_unified": "off", "swa_full": "yes", "tensor_split": "3, 1", "devices": "VGPU0=2GiB",
              "type_k": "q8_0", "pad": "", "n_seq_max": "default"}
    assert parse_settings(fields) == dict(n_ctx=512, kv_unified=False, swa_full=True, tensor_split=[3.0, 1.0],
                                          devices=["VGPU0=2GiB"], type_k="q8_0")


@pytest.mark.parametrize("name,raw,message", [
    ("n_ctx", "lots", "n_ctx: 'lots' is not a whole number"),
    ("kv_unified", "maybe", "kv_unified: 'maybe' is not true or false"),
    ("tensor_split", "3,x", "tensor_split: '3,x' is not a comma-separated list"),
    ("n_cxt", "5", "n_cxt: not a setting"),
])
def test_a_bad_field_is_named(name, raw, message):
    with pytest.raises(ValueError, match=message):
        parse_settings({name: raw})


def test_a_shown_value_parses_back_to_itself():
    values = dict(n_ctx=256, kv_unified=True, tensor_split=[3.0, 1.0], devices=["VGPU0=2GiB", "VGPU1=1GiB"], type_v="f16")
    assert parse_settings({name: shown(v) for name, v in values.items()}) == values
    assert {name for name, _, _ in SETTINGS} >= set(values)


def test_the_estimate_lines_name_each_device_and_say_when_it_does_not_fit():
    with Session("demo", threaded=False) as session:
        fits, lines = estimate_lines(session.estimate(n_ctx=512))
        assert fits and lines[0] == "fits: True" and lines[1].startswith("CPU")
        fits, lines = estimate_lines(session.estimate(n_ctx=4096, n_gpu_layers=99, devices=["VGPU0=1MiB"]))
        assert not fits and any("VGPU0" in line and "DOES NOT FIT" in line and "(virtual)" in line for line in lines)


@pytest.mark.parametrize("setting", [dict(publish_attention=True), dict(publish_logits=True), dict(kv_cache_debug=1)])
def test_a_session_that_publishes_more_still_estimates_its_memory(setting):
    with Session("demo", settings=dict(n_ctx=256, **setting), threaded=False) as session:
        plain = Session("demo", settings=dict(n_ctx=256), threaded=False)
        try:
            parts = ("device", "model_bytes", "kv_bytes", "compute_bytes")  # the host's free memory moves meanwhile
            assert [{k: d[k] for k in parts} for d in session.estimate().to_dict()["devices"]] == \
                [{k: d[k] for k in parts} for d in plain.estimate().to_dict()["devices"]]
        finally:
            plain.close()
