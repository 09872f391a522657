"""Layout algebra shared by every stage: ``shape:stride`` values, strided copies as minimal runs, and
where a token lives when context parallelism shards tokens over ranks. Pure integer rules, no I/O."""
