"""``kvlc explain``: what a plan holds, as tables, JSON and pages drawn to scale; request sizes.

Pure: reads :class:`~kvlc.compiler.plan.model.Plan` values (and pairs them through the public
compiler API), returns values and text. No nixl, no torch. One module per concern:

    numbers   exact bytes, binary units (compact integer sets: :mod:`kvlc.collapse`)
    summary   per region / storage / memory type / group, per rank and per engine
    tables    text cells of every table (terminal: rendering them, never cutting a number)
    blocks    the byte map of one block of each layout (fields, dim order, replication)
    page      ``kvlc explain --html``: storages to scale per memory type, block maps
    pairing   ``kvlc pair --html``: which consumer rank reads which producer heads and tokens
    size      bytes and descriptors of one request of N tokens (sizetext: its tables)
    program_view  a program's pieces and runs as plain tuples
    docs      the JSON documents of ``--json``

Import from the module that defines a name; this package re-exports nothing.
"""
