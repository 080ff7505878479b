"""What the records say about causes: pure functions over prompts, records and counters,
no I/O and no clock of their own (time is passed in).

``prefix``: the prompt-cache doctor (how much of a prompt repeated a recent request's
prefix, how much the upstream reported as cached, where and why the prefix broke);
``prefix_index``: where it remembers recent prompts' block keys.
``fit``: the prefill fit, first-token time against uncached prompt tokens, from sums that
add across replicas and windows; ``levers``: the first token split into its causes and the
levers ranked by the milliseconds they would save.
"""
