"""The torch-free description of pipeline schedules, used by ``resolve`` and ``simulate``.

``schedule`` names the schedules ``torch.distributed.pipelining`` ships (``SCHEDULES``), says
which combinations of pipeline ranks, microbatches and stages per rank torch will run
(``check_schedule``), computes each rank's ordered compute actions ourselves
(``schedule_actions``), and times them in an event simulation for the bubble and the activations
each rank holds in flight (``simulate_timeline``, ``bubble_fraction``). Nothing here imports
torch, so compiling a recipe and the dry run can reason about a schedule without it; the runtime
that builds torch's schedule objects and runs them lives elsewhere.

``view`` restricts a pipelined plan to the stages one model object holds (``stage_view``): what
the runtime applies to a stage model beside tensor parallel. It filters, it decides nothing.
"""
