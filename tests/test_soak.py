"""A short soak of llama-server with RidgeFill (ridgefill_gguf.soak; tools/soak_server.py runs the 1,000-request
one): mixed lengths over 4 slots, RidgeFill on and off, the prompt cache on and off, cancellations in the middle of
a prefill. No request fails, the server is alive at the end, and with RidgeFill off the patched server's text is
upstream's for every finished stock request."""
from __future__ import annotations

from conftest import require_builds
from ridgefill_gguf.maps.synthetic import tiny_model_with_maps
from ridgefill_gguf.soak import run_soak


def test_a_short_soak_of_mixed_requests_and_cancellations_has_no_error_and_off_is_upstream(tmp_path):
    require_builds()
    model, maps = tiny_model_with_maps(tmp_path, "llama", n_layer=4, split=1)
    r = run_soak(model, maps, n=120, log_dir=tmp_path, log=lambda *_: None)
    assert not r["errors"] and r["server_alive"], r["errors"][:5]
    assert r["cancelled"] > 0 and r["ridgefill_ran"] > 10 and r["stock_compared"] > 10
    assert not r["off_vs_upstream_alone"]
