"""The hypothesis strategy of packed layouts that the attention tests draw from."""
from hypothesis import strategies as st

from nemo_anchor.attention import MODES


@st.composite
def packed_layouts(draw, max_docs: int = 7, max_doc_len: int = 12, query_range: bool = True):
    """``(doc_bounds, window_bounds, mode, q_offset, q_len)``: documents of 1..``max_doc_len`` tokens,
    windows starting at random document boundaries, and with ``query_range`` sometimes only a range
    of the queries (the rows of a context-parallel chunk)."""
    lengths = draw(st.lists(st.integers(1, max_doc_len), min_size=1, max_size=max_docs))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    windows = [0] + [b for b in bounds[1:-1] if draw(st.booleans())] + [total]
    q_offset, q_len = 0, total
    if query_range and draw(st.booleans()):
        q_offset = draw(st.integers(0, total - 1))
        q_len = draw(st.integers(1, total - q_offset))
    return tuple(bounds), tuple(windows), draw(st.sampled_from(MODES)), q_offset, q_len
