"""What the records say about causes: pure functions over records and counters, no I/O
and no clock of their own (time is passed in). The prompt-cache doctor is
:mod:`proxy.doctor`.

Design: ``docs/design/diagnosis.md``.
"""
