"""A short soak of llama-server with RidgeFill (ridgefill_gguf.soak; tools/soak_server.py runs the 1,000-request
one): mixed lengths over 4 slots, RidgeFill on and off, the prompt cache on and off, cancellations in the middle of
a prefill, on a tiny llama and a tiny qwen35 hybrid. No request fails, the server is alive at the end, and with
RidgeFill off the patched server's text is upstream's for every finished stock request."""
from __future__ import annotations

import pytest

from conftest import require_builds
from ridgefill_gguf.soak import run_soak, soak_model


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_short_soak_of_mixed_requests_and_cancellations_has_no_error_and_off_is_upstream(arch, tmp_path):
    # qwen35: a hybrid's late layers yield to the other slots and its slots save checkpoints
    require_builds()
    model, maps = soak_model(tmp_path, arch)
    r = run_soak(model, maps, n=120, log_dir=tmp_path, log=lambda *_: None)
    assert not r["errors"] and r["server_alive"], r["errors"][:5]
    assert r["cancelled"] > 0 and r["ridgefill_ran"] > 10 and r["stock_compared"] > 10
    print(f"{arch}: {r['ridgefill_cancelled_in_flight']} RidgeFill prefills cancelled in flight; RSS MiB "
          f"{r['rss_mib']}, upstream's {r['upstream_rss_mib']}")
    assert not r["off_vs_upstream_alone"]
