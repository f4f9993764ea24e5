"""Per-pass state: one mechanism (bam_pyro.pass_context), nested blocks, one thread's blocks unseen
by another; the settings built on it (attention sites, noise compilation) and the guide's own state."""

import threading

from bam_pyro import AttentionGuide
from bam_pyro.fused import _NOISE_COMPILED, compile_noise
from bam_pyro.pass_context import PassContext
from bam_pyro.sites import active_sites, attention_sites


def in_other_thread(read):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(read()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_block_sets_the_value_and_leaving_it_restores_the_outer_one():
    context = PassContext("outside")
    assert context.current() == "outside"
    with context.entered("outer"):
        with context.entered("inner") as value:
            assert value == context.current() == "inner"
        assert context.current() == "outer"
    assert context.current() == "outside"


def test_a_block_is_left_when_its_body_raises():
    context = PassContext(0)
    try:
        with context.entered(1):
            raise KeyError
    except KeyError:
        pass
    assert context.current() == 0


def test_another_thread_sees_the_default_not_this_threads_block():
    context = PassContext(None)
    with context.entered("here"):
        assert in_other_thread(context.current) is None
        assert context.current() == "here"


def test_attention_sites_and_noise_compilation_are_per_thread_blocks():
    with attention_sites(0.5) as sites, compile_noise():
        assert active_sites() is sites and _NOISE_COMPILED.current() is True
        assert in_other_thread(active_sites) is None
        assert in_other_thread(_NOISE_COMPILED.current) is False
        with compile_noise(False):
            assert _NOISE_COMPILED.current() is False
    assert active_sites() is None and _NOISE_COMPILED.current() is False


def test_each_guide_keeps_its_own_site_state():
    first, second = AttentionGuide(lambda: None), AttentionGuide(lambda: None)
    assert first._infer == {} and first._infer is not second._infer
