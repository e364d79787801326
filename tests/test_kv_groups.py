"""KV groups: a model with sliding-window and full-context layers (Gemma 2/3) keeps each kind's KV in
groups of its own, and a window group's blocks go back once no query can see them. The block
counter shows the saving; the tokens stay the reference loop's; prefix hits stay correct."""
import pytest
import torch

from inferd.engine.kv_cache import BlockManager
from inferd.engine.request import Request, SamplingParams
from inferd.worker.kv_pool import kv_layout

GEMMA3_270M_WINDOWS = ([512] * 5 + [None]) * 3  # 18 layers, llama.cpp's pattern of 6, window 512


def ceil_div(a, b):
    return -(-a // b)


def test_gemma3_270m_layout_is_six_groups_of_three_layers():
    lay = kv_layout(GEMMA3_270M_WINDOWS, 18)
    assert lay.group_size == 3 and lay.windows == (None,) + (512,) * 5
    assert [i for i, g in enumerate(lay.group_of) if g == 0] == [5, 11, 17]
    # every (group, row) pair holds exactly one layer
    assert len({(g, s) for g, s in zip(lay.group_of, lay.slot_of)}) == 18
    assert kv_layout(None, 4).num_groups == 1 and kv_layout(16, 4).windows == (16,)


def _req(ids):
    return Request("r", list(ids), SamplingParams(max_tokens=1), 0.0)


def test_window_blocks_go_back_and_prefix_hits_need_them():
    """Block size 4, a window of 8 in group 1: as a 40-token prompt advances, group 1 keeps only the
    blocks the next query sees (NULL before them), the full group every block; a second request
    with the same prompt hits the full blocks only as far as the window group's blocks of its last
    window are still cached."""
    bm = BlockManager(20, 4, enable_prefix_caching=True, group_windows=(8,))
    ids = list(range(100, 140))
    a = _req(ids)
    bm.match_prefix(a)
    for n in (16, 16, 8):
        assert bm.allocate(a, n)
        a.num_computed += n
        bm.register_full_blocks(a)
        bm.check_invariants([a])
    assert len(a.block_table) == 10
    # the last allocation came at 32 computed: the next query (32) sees 25..32, blocks 6.. in group 1
    assert a.kv_tables[0][:6] == [bm.NULL] * 6 and bm.NULL not in a.kv_tables[0][6:]
    assert bm.held_blocks(a) == 10 + 4 and bm.num_used == 14
    bm.slide(a)  # at 40 computed the next query sees 33..40: blocks 8 and 9
    assert bm.held_blocks(a) == 10 + 2 and bm.num_used == 12
    window_blocks = {i: a.kv_tables[0][i] for i in (8, 9)}
    bm.free_request(a)
    bm.check_invariants([])
    assert bm.num_free == 20 and not bm.free  # every block was used once and is findable

    b = _req(ids)
    # 9 full blocks leave one token; at 36 the next query sees 29..36: group 1's blocks 7 and 8,
    # released by `a` as it advanced and still findable
    assert bm.match_prefix(b) == 36
    assert b.kv_tables[0][:7] == [bm.NULL] * 7 and b.kv_tables[0][8] == window_blocks[8]
    bm.check_invariants([b])
    bm.free_request(b)



def _advance(bm, req, chunks):
    for n in chunks:
        assert bm.allocate(req, n)
        req.num_computed += n
        bm.register_full_blocks(req)


def _evict(bm, *blocks):
    """Make these cached blocks the next ones a fresh allocation evicts (20 blocks: none free)."""
    for b in reversed(blocks):
        bm.evictable.move_to_end(b, last=False)
    holder = _req([7])
    holder.block_table = [bm._take() for _ in blocks]  # what an allocation does, without its tables' shape
    return holder


def test_a_hit_stops_where_the_window_group_lost_a_block():
    """The full group keeps blocks 0..8 of the prompt but group 1 lost its block 8: at 36 tokens the
    next query would need it, so the hit stops at 32 (whose next query sees blocks 6 and 7, both
    there); with the full group's block 0 gone too, nothing hits."""
    ids = list(range(100, 140))
    bm = BlockManager(20, 4, enable_prefix_caching=True, group_windows=(8,))
    a = _req(ids)
    bm.match_prefix(a)
    _advance(bm, a, (16, 16, 8))
    full0, win8 = a.block_table[0], a.kv_tables[0][8]
    bm.free_request(a)
    c = _evict(bm, win8)
    d = _req(ids)
    assert bm.match_prefix(d) == 32 and len(d.block_table) == 8
    assert d.kv_tables[0][:6] == [bm.NULL] * 6 and bm.NULL not in d.kv_tables[0][6:8]
    bm.check_invariants([c, d])
    bm.free_request(d)
    e = _evict(bm, full0)
    f = _req(ids)
    assert bm.match_prefix(f) == 0 and not f.block_table and f.kv_tables == [[]]
    for r in (c, e, f):
        bm.free_request(r)
    bm.check_invariants([])
    assert bm.num_free == 20


def _gemma3_tiny(tmp_path, window, layers=6, max_pos=8192):
    transformers = pytest.importorskip("transformers")
    from test_families import TINY, widen

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**{
        **TINY, "num_hidden_layers": layers, "sliding_window": window, "query_pre_attn_scalar": 16,
        "max_position_embeddings": max_pos, "tie_word_embeddings": True,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    hf = widen(transformers.Gemma3ForCausalLM(cfg))
    hf.save_pretrained(tmp_path)
    return str(tmp_path)


def window_bound(eng, tokens: int, chunk: int) -> int:
    """Blocks a request of `tokens` may hold: every block of each full group, and per window group
    its window and one step's chunk (plus the partly seen block at each end)."""
    lay, bs = eng.kv_layout, eng.config.block_size
    return sum(ceil_div(tokens, bs) if w is None else ceil_div(w - 1 + chunk, bs) + 1 for w in lay.windows)


def run_long_request(eng, prompt, n_new):
    """Step one request to its end: the most blocks the engine's counter showed (any step, and the
    steps after its prompt), and its tokens."""
    eng.add_request(prompt, SamplingParams(max_tokens=n_new, temperature=0))
    peak, decoding, out = 0, 0, []
    while eng.has_unfinished():
        for o in eng.step():
            out.extend(o.new_token_ids)
        peak = max(peak, eng.block_manager.num_used)
        if out:
            decoding = max(decoding, eng.block_manager.num_used)
    return peak, decoding, out


def test_a_4k_request_holds_the_full_layers_and_the_windows(tmp_path):
    """Gemma 3's pattern (five window layers of 512, one full) on tiny weights: a 4,100-token request
    in chunks of 512 holds at most the full group's blocks and each window group's window (plus a
    chunk while its prompt runs): the block counter at every step, about a third of what one table for
    every layer would hold. Its tokens are the reference loop's."""
    from helpers import assert_no_leaks, compare

    from inferd.engine.engine import LLMEngine
    from inferd.engine.reference import reference_generate
    from inferd.loading.loader import load_model

    path = _gemma3_tiny(tmp_path, window=512)
    lm = load_model(path, dtype="float32", with_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (4100,), generator=g).tolist()
    ref = reference_generate(lm.model, prompt, 8, keep_logits=True)
    chunk = 512
    eng = LLMEngine(loaded=lm, dtype="float32", block_size=16, max_num_batched_tokens=chunk,
                    kv_cache_memory="64MiB")
    peak, decoding, out = run_long_request(eng, prompt, 8)
    compare([out], [(ref.token_ids, ref.logits)], max_ties=1)
    tokens = len(prompt) + 8
    assert eng.kv_layout.num_groups == 6 and eng.kv_layout.group_size == 1
    assert decoding <= window_bound(eng, tokens, 1)  # 258 + 5 x 33 = 423
    assert peak <= window_bound(eng, tokens, chunk)
    one_table = 6 * ceil_div(tokens, 16)  # 1542: a table for every layer, in the same blocks
    assert peak < one_table / 2.5
    assert_no_leaks(eng)
