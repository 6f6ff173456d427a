"""Multi-turn, tool-using episodes.

An episode is a conversation that the engine extends turn by turn. The model's turn is generated
like any response; when it ends (end of turn, or the closing tag of a tool call), the episode's
environment reads it and answers: a tool's result, feedback, or nothing (the episode is over).
Its answer is appended to the same `Sample` as tokens no policy sampled (version
`trainer.engine.base.ENV_VERSION`, log-probability 0): the next turn is generated after them,
the loss never trains them (trainer/algo/objective.py masks them), and the token ledger counts
them apart ("environment", never "generated" or "trained").

- `tools`: the tools a model may call (a calculator; Python in the code sandbox), their strict
  parsers, and their limits: a tool's failure is the tool's message, never an exception.
- `turns`: how an environment turn is written into the conversation: the model's chat template
  (system, user, assistant, tool) for real models, a plain format for the built-in model.
- `environments`: what answers a turn: tools, feedback after a wrong answer.
- `engine`: `Episodes`, a wrapper around any rollout engine (embedded, process pool, SGLang)
  that runs the environment between turns (tools on worker threads, beside decoding) and
  resubmits the sample, so every rollout driver (synchronous, APRIL, asynchronous) and GRESO
  see whole episodes.

Episodes are stateless between turns: everything an environment needs is in the sample's tokens
and in `sample.meta["episode"]` (plain data, checkpointed with the sample), so a parked episode,
mid-turn or between turns, resumes exactly, in another step or another process.
"""
