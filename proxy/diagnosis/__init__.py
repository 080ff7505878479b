"""What the records say about causes: pure functions over records and counters, no I/O."""
