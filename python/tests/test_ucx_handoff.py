"""A handoff the library moves itself, over UCX: the decode side's
Receiver serves on an address (serve_ucx), the prefill side sends an
export there (Export.send_ucx over a UCXTransport), and the decode lease,
taken by request ID, holds exactly the prefill's bytes in every cache
group (the hybrid pools of test_hybrid_handoff). A replay is refused
with the receiver's reason.

The library has UCX when built with the Go build tag ucx (libucx-dev):
scripts/ci-ucx.sh builds it so and runs this file with KVF_REQUIRE_UCX=1;
elsewhere the calls must say Unavailable, which the last test checks.
"""

import os

import pytest

import kvfence
from test_hybrid_handoff import KEY, PROMPT, config, holds, prefill

needs_ucx = pytest.mark.skipif(not kvfence.ucx_available() and os.environ.get("KVF_REQUIRE_UCX") != "1",
                               reason="libkvfence was built without UCX")


@needs_ucx
def test_handoff_over_ucx_moves_every_group():
    assert kvfence.ucx_available(), "KVF_REQUIRE_UCX=1 and a library without UCX"
    with kvfence.Pool(config()) as src, kvfence.Pool(config()) as dst, \
            dst.receiver(KEY) as recv, recv.serve_ucx("127.0.0.1:0") as srv, \
            kvfence.UCXTransport(srv.address, {"message_timeout_ms": 30000}) as tr:
        assert srv.address.startswith("127.0.0.1:")
        assert recv.take("py-ucx") is None
        lease = prefill(src, "py-ucx", seed=5)
        with lease.export(KEY, max_new_tokens=8) as exp:
            exp.send_ucx(tr, timeout_ms=30000)
        got = recv.take("py-ucx")
        assert got is not None
        assert holds(dst, got, seed=5) == []
        assert recv.take("py-ucx") is None, "a lease taken twice"
        got.release()
        lease.free()

        again = prefill(src, "py-ucx", seed=5)
        with again.export(KEY, max_new_tokens=8) as exp:
            with pytest.raises(kvfence.Replay):
                exp.send_ucx(tr, timeout_ms=30000)
        again.free()
        src.check()
        dst.check()


def test_ucx_unavailable_or_refusals():
    with kvfence.Pool(config()) as dst, dst.receiver(KEY) as recv:
        with pytest.raises(kvfence.InvalidConfig):
            kvfence.UCXTransport("127.0.0.1:1", {"data_path": "rdma"})
        if not kvfence.ucx_available():
            with pytest.raises(kvfence.Unavailable):
                recv.serve_ucx("127.0.0.1:0")
            with pytest.raises(kvfence.Unavailable):
                kvfence.UCXTransport("127.0.0.1:1")
