"""What the records say about causes: pure functions over records and counters, no I/O
and no clock of their own (time is passed in). The prompt-cache doctor is
:mod:`proxy.doctor`.

``fit``: the prefill fit, first-token time against uncached prompt tokens, from sums that
add across replicas and windows; ``levers``: the first token split into its causes and the
levers ranked by the milliseconds they would save.
"""
