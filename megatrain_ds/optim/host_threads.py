"""The host threads of the optimizer (optimizer.py), and what each hands the others.

[Note: host threads]

Three threads touch the optimizer: the main thread (the script's: backward, step, forward), the
landing thread (``worker``, "megatrain-host": gradient folds, squared norms, the norm task) and the
AdamW thread (``opt_worker``, "megatrain-adamw": speculative updates, then each step's update tasks,
then its close task, then its deferred moments passes). Each host thread is FIFO. What one of them
writes and another reads goes through one of these hand-offs (a future, the order of a FIFO submit,
or a flag named here); everything else of HostAdamW is the main thread's:

| hand-off                   | produced by (thread)    | waited / read by       | orders /         |
|                            |                         | (thread)               | protects         |
|----------------------------|-------------------------|------------------------|------------------|
| landing future             | main submits the fold;  | the norm task (landing | the window's     |
| (``schedule.landing``,     | the landing thread      | thread, FIFO after     | gradient sum is  |
| ``res.sq_norm``)           | returns its sq-norm     | them); engine after a  | in its host      |
|                            |                         | failed backward        | home, its norm   |
|                            |                         |                        | known            |
| ``LandingListener`` calls  | landing thread, inside  | HostAdamW on the       | a speculative    |
| (landing.py)               | the landing task        | landing thread: it     | update reads a   |
|                            |                         | submits the            | gradient only    |
|                            |                         | speculative update to  | after its final  |
|                            |                         | the AdamW thread       | fold             |
| ``_unspeculate`` (a second | landing thread submits  | AdamW thread           | the undo uses    |
| final landing of a layer)  | it and waits            |                        | the gradient the |
|                            | (``.result()``) before  |                        | step used, not   |
|                            | the fold                |                        | the sum the fold |
|                            |                         |                        | writes           |
| ``_landing_spec``          | main:                   | landing thread (the    | each landing's   |
|                            | ``begin_speculation``   | listener calls)        | submit orders    |
|                            | (before the backward    |                        | the write before |
|                            | queues its landings),   |                        | its reads        |
|                            | ``abandon_speculation`` |                        |                  |
| ``Speculation``:           | landing thread          | AdamW thread, before   | a cancel flag:   |
| ``stopped``, ``closed``    | (listener, norm task);  | each speculative       | updates not      |
|                            | main (abandon, after    | update                 | started are left |
|                            | the landings ran)       |                        | to the plain     |
|                            |                         |                        | update           |
| ``Speculation``: ``done``, | AdamW thread            | AdamW tasks queued     | which layers a   |
| ``resident_done``          | (speculative updates)   | after them (FIFO);     | settle or an     |
|                            |                         | main after             | undo treats      |
|                            |                         | ``undo_all``; the norm |                  |
|                            |                         | task (a read-ahead     |                  |
|                            |                         | hint)                  |                  |
| decision future (the norm  | landing thread, after   | the step's AdamW tasks | no update before |
| task's ``StepDecision``)   | every landing of the    | (``.result()``); main: | the norm; skip,  |
|                            | window (FIFO)           | engine.step waits the  | coefficient,     |
|                            |                         | norm future made from  | Adam step,       |
|                            |                         | it, then               | verdict,         |
|                            |                         | ``_decided()``         | message, error:  |
|                            |                         |                        | one immutable    |
|                            |                         |                        | value            |
| loss scaler                | landing thread (the     | main, after the norm   | the scale of the |
| (``scaler.update``)        | norm task)              | future: the next       | next backward    |
|                            |                         | backward,              |                  |
|                            |                         | ``cur_scale``          |                  |
| update futures             | main submits the AdamW  | main:                  | a wire copy is   |
| (``schedule.rewrite``,     | tasks                   | ``wait_rewritten(i)``  | rewritten before |
| ``res.rewrite``)           |                         | before the H2D of wire | an H2D reads it; |
|                            |                         | i; ``res.upload`` (the | a GPU-held       |
|                            |                         | result: an opt event)  | resident update  |
|                            |                         |                        | is done          |
| ``wire_read[i]``           | main, when it issues    | the AdamW tasks queued | the H2D reading  |
| (schedule),                | the H2D                 | after it               | the old bytes    |
| ``res.wire_read`` (events) |                         | (``synchronize``       | has finished     |
|                            |                         | before a rewrite)      |                  |
| moments futures            | main submits the        | main:                  | the moments pass |
| (``schedule.moments_due``) | moments tasks after the | ``wait_moments(i)``    | has read         |
|                            | close task (last layer  | before the D2H into    | gradient i and   |
|                            | first); the AdamW       | grad i; landing thread | written the      |
|                            | thread runs them        | before a fold into     | moments before a |
|                            |                         | grad i; engine.        | new gradient of  |
|                            |                         | synchronize            | i lands or       |
|                            |                         |                        | anyone reads the |
|                            |                         |                        | moments          |
| ``_closing`` (the close    | main submits it after   | main:                  | the policy's     |
| task)                      | the step's update       | ``begin_speculation``, | record of the    |
|                            | tasks; the AdamW thread | ``engine.synchronize`` | step is in       |
|                            | writes ``policy``       |                        | before the next  |
|                            |                         |                        | speculation      |
| abandon: a no-op landing   | main                    | main waits for each in | the landings     |
| task, then ``undo_all``    |                         | turn                   | have run (no     |
|                            |                         |                        | more speculative |
|                            |                         |                        | updates queued), |
|                            |                         |                        | then they are    |
|                            |                         |                        | undone           |

Adam's step count is the main thread's: the norm task receives it (``enqueue_step`` waits for the
previous decision) and returns the advanced one in its decision (``step_count`` reads it).
"""
