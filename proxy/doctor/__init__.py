"""The prompt-cache doctor: prompt parts in, keys, an index (in process or shared),
findings out. How much of a prompt repeated a recent request's prefix, how much the
upstream reported cached, and where and why the prefix broke.

One way through: :mod:`~proxy.doctor.job` places a request's job (the loop, a thread,
or none), then runs the one examination (:mod:`~proxy.doctor.keys`,
:mod:`~proxy.doctor.index` or :mod:`~proxy.doctor.shared_index`,
:mod:`~proxy.doctor.examine`) and turns its report into the record's terms
(:mod:`~proxy.doctor.report`). The finding is :class:`proxy.measure.PrefixRecord`,
kept with the request record it is part of; the live page's examples are
:mod:`proxy.ui.breaks`, and the workload capture turns the keys into block ids itself
(:class:`proxy.workload_capture.PrefixKeys`). ``docs/design/doctor.md`` holds the design.
"""
