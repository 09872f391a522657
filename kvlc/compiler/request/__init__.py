"""Per request, the hot path: block ids and a token range → checked → descriptor rows or prepared indices.

Free functions over the frozen :class:`~kvlc.compiler.pairing.program.TransferProgram`, in the
order a request flows (their derived lookup structures are kept in the program's memo):

    tokens       TokenRange (the one token-range type) and the token / block / tile arithmetic
    index        program_index: entries grouped for vectorized instantiation, per-side geometry
    rules        request_rules, prepare: what each group's ids must satisfy, derived once
    check        check_request: ids and range checked → a Request of kernel block ids
    bind         bind: storage base addresses fixed once per connection → BoundProgram
    rows         (N, 3) row arithmetic and coalescing
    instantiate  instantiate / emit: a request → (N, 3) descriptors per part
    prepared     prepared_rows / prepared_indices: strided lists once, int32 indices per request
    windows      window_stats: the most a sliding-window group moves per request
"""
