"""The host threads of the optimizer (optimizer.py), and what each hands the others.

[Note: host threads]

Three threads touch the optimizer: the main thread (the script's: backward, step, forward), the landing thread
(``worker``, "megatrain-host": gradient folds, squared norms, the norm task) and the AdamW thread (``opt_worker``,
"megatrain-adamw": speculative updates, then each step's update tasks, then its close task, then its deferred moments
passes). Each host thread is FIFO.
What one of them writes and another reads goes through one of these hand-offs (a future, the order of a FIFO submit,
or a flag named here); everything else of HostAdamW is the main thread's:

| hand-off                  | produced by (thread)       | waited / read by (thread)    | orders / protects           |
|---------------------------|----------------------------|------------------------------|-----------------------------|
| landing future            | main submits the fold; the | the norm task (landing       | the window's gradient sum   |
| (``schedule.landing``,    | landing thread returns its | thread, FIFO after them);    | is in its host home, its    |
| ``res.sq_norm``)          | sq-norm                    | engine after a failed        | norm known                  |
|                           |                            | backward                     |                             |
| ``LandingListener`` calls | landing thread, inside the | HostAdamW on the landing     | a speculative update reads  |
| (landing.py)              | landing task               | thread: it submits the       | a gradient only after its   |
|                           |                            | speculative update to the    | final fold                  |
|                           |                            | AdamW thread                 |                             |
| ``_unspeculate`` (a       | landing thread submits it  | AdamW thread                 | the undo uses the gradient  |
| second final landing of a | and waits (``.result()``)  |                              | the step used, not the sum  |
| layer)                    | before the fold            |                              | the fold writes             |
| ``_landing_spec``         | main:                      | landing thread (the listener | each landing's submit       |
|                           | ``begin_speculation``      | calls)                       | orders the write before its |
|                           | (before the backward       |                              | reads                       |
|                           | queues its landings),      |                              |                             |
|                           | ``abandon_speculation``    |                              |                             |
| ``Speculation``:          | landing thread (listener,  | AdamW thread, before each    | a cancel flag: updates not  |
| ``stopped``, ``closed``   | norm task); main (abandon, | speculative update           | started are left to the     |
|                           | after the landings ran)    |                              | plain update                |
| ``Speculation``:          | AdamW thread (speculative  | AdamW tasks queued after     | which layers a settle or an |
| ``done``,                 | updates)                   | them (FIFO); main after      | undo treats                 |
| ``resident_done``         |                            | ``undo_all``; the norm task  |                             |
|                           |                            | (a read-ahead hint)          |                             |
| decision future (the norm | landing thread, after      | the step's AdamW tasks       | no update before the norm;  |
| task's ``StepDecision``)  | every landing of the       | (``.result()``); main:       | skip, coefficient, Adam     |
|                           | window (FIFO)              | engine.step waits the norm   | step, verdict, message,     |
|                           |                            | future made from it, then    | error: one immutable value  |
|                           |                            | ``_decided()``               |                             |
| loss scaler               | landing thread (the norm   | main, after the norm future: | the scale of the next       |
| (``scaler.update``)       | task)                      | the next backward,           | backward                    |
|                           |                            | ``cur_scale``                |                             |
| update futures            | main submits the AdamW     | main: ``wait_rewritten(i)``  | a wire copy is rewritten    |
| (``schedule.rewrite``,    | tasks                      | before the H2D of wire i;    | before an H2D reads it; a   |
| ``res.rewrite``)          |                            | ``res.upload`` (the result:  | GPU-held resident update is |
|                           |                            | an opt event)                | done                        |
| ``wire_read[i]``          | main, when it issues the   | the AdamW tasks queued after | the H2D reading the old     |
| (schedule),               | H2D                        | it (``synchronize`` before a | bytes has finished          |
| ``res.wire_read``         |                            | rewrite)                     |                             |
| (events)                  |                            |                              |                             |
| moments futures           | main submits the moments   | main: ``wait_moments(i)``    | the moments pass has read   |
| (``schedule.moments_due``)| tasks after the close task | before the D2H into grad i;  | gradient i and written the  |
|                           | (last layer first); the    | landing thread before a fold | moments before a new        |
|                           | AdamW thread runs them     | into grad i; engine.         | gradient of i lands or      |
|                           |                            | synchronize                  | anyone reads the moments    |
| ``_closing`` (the close   | main submits it after the  | main: ``begin_speculation``, | the policy's record of the  |
| task)                     | step's update tasks; the   | ``engine.synchronize``       | step is in before the next  |
|                           | AdamW thread writes        |                              | speculation                 |
|                           | ``policy``                 |                              |                             |
| abandon: a no-op landing  | main                       | main waits for each in turn  | the landings have run (no   |
| task, then ``undo_all``   |                            |                              | more speculative updates    |
|                           |                            |                              | queued), then they are      |
|                           |                            |                              | undone                      |

Adam's step count is the main thread's: the norm task receives it (``enqueue_step`` waits for the previous decision)
and returns the advanced one in its decision (``step_count`` reads it).
"""
