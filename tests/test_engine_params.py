"""The prefill's parameters: one struct with defaults, a setter that names a bad field, research controls apart."""
from __future__ import annotations

import json

from conftest import require_builds, run_py
from ridgefill_gguf.engine import bindings
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file

CODE = r"""
import ctypes, json, sys
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, verbose=False)
lib = bindings._prefill_lib()
bindings.attach(llm.ctx, bindings.load_maps(llm.model, sys.argv[2]))
out = {"defaults": bindings.params(llm.ctx)}
d = lib.llama_ridgefill_default_params()
out["default_params"] = {n: getattr(d, n) for n, _ in bindings.Params._fields_}
p = lib.llama_ridgefill_default_params()
p.probe_rows, p.probe_budget, p.n_tail = 128, 1.5, 77
out["set"] = lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(p))
out["after_set"] = bindings.params(llm.ctx)
bad = lib.llama_ridgefill_default_params()
bad.probe_share = 1.5
out["bad"] = [lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(bad)), lib.llama_ridgefill_last_error().decode()]
out["after_bad"] = bindings.params(llm.ctx)
update = lib.llama_ridgefill_default_params()
update.state_update = 7
out["bad_update"] = [lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(update)), lib.llama_ridgefill_last_error().decode()]
table = lib.llama_ridgefill_default_params()
table.protected_share = 0.25
out["no_table"] = [lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(table)), lib.llama_ridgefill_last_error().decode()]
sel = lib.llama_ridgefill_default_params()
out["select_random"] = [lib.llama_ridgefill_params_select(ctypes.byref(sel), b"random", -1.0, 1.0, 256),
                        lib.llama_ridgefill_last_error().decode()]
lib.llama_ridgefill_params_select(ctypes.byref(sel), b"probe", -1.0, 1.0, 256)
out["select_probe"] = [sel.probe_rows, sel.probe_budget, sel.probe_share]
# research controls: listed rows run exactly until the next set_params
tokens = llm.tokenize(b"Listed rows run exactly until the parameters are set again. " * 12, add_bos=True)
def exact_rows_after_prefill():
    llama_cpp.llama_cpp.llama_memory_clear(llama_cpp.llama_cpp.llama_get_memory(llm.ctx), True)
    bindings.prefill(llm.ctx, tokens)
    return bindings.exact_rows(llm.ctx)
base = lib.llama_ridgefill_default_params()
base.n_tail, base.min_prefix = 16, 0
lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(base))
rows = (ctypes.c_int32 * 2)(5, 9)
lib.llama_ridgefill_research_set_exact_rows(llm.ctx, rows, 2)
out["listed"] = exact_rows_after_prefill()
lib.llama_ridgefill_set_params(llm.ctx, ctypes.byref(base))
out["after_reset"] = exact_rows_after_prefill()
print(json.dumps(out))
"""


def run(tmp_path):
    import dataclasses

    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=4)
    model = write_random_model(tmp_path / "qwen3.gguf", shape, seed=2)
    src = write_float_file(tmp_path / "maps.safetensors", 1, [2, 3], shape.n_embd, dtype="f32")
    maps = convert(src, tmp_path / "maps.gguf", model=model).out
    code = f"import sys; sys.argv = ['x', {str(model)!r}, {str(maps)!r}]\n" + CODE
    return json.loads(run_py(code, "ridgefill").stdout.strip().splitlines()[-1])


def test_the_parameters_are_one_struct_with_defaults_and_a_setter_that_names_a_bad_field(tmp_path):
    require_builds("ridgefill")
    out = run(tmp_path)
    assert out["defaults"] == out["default_params"]
    assert out["defaults"]["n_tail"] == -1 and out["defaults"]["min_prefix"] == 256 and out["defaults"]["chunk"] == 4096
    assert out["defaults"]["probe_rows"] == 0 and out["defaults"]["whole_numbers"] is True
    assert out["set"] == 0
    assert out["after_set"]["probe_rows"] == 128 and out["after_set"]["n_tail"] == 77
    assert abs(out["after_set"]["probe_budget"] - 1.5) < 1e-6
    # a bad field is named and nothing changes
    assert out["bad"] == [-1, "probe_share must be in [0, 1], not 1.500000"]
    assert out["after_bad"] == out["after_set"]
    # a hybrid's carry asks the fused op for its blocked form unless told to walk the rows or take the chunked graph
    assert out["defaults"]["state_update"] == bindings.STATE_UPDATES["blocked"]
    assert out["bad_update"] == [-1, "state_update must be 0 (fused), 1 (chunked) or 2 (blocked), not 7"]
    assert out["no_table"][0] == -1 and "rf_token_freq" in out["no_table"][1]
    # the servers' names map onto the struct; a research control is not one of them
    assert out["select_random"][0] == -1 and "unknown selector 'random'" in out["select_random"][1]
    assert out["select_probe"] == [256, 1.0, 0.0]


def test_setting_the_parameters_turns_the_research_controls_off(tmp_path):
    require_builds("ridgefill")
    out = run(tmp_path)
    assert out["listed"] == [0, 5, 9]  # the BOS always, and the listed rows
    assert out["after_reset"] == [0]
