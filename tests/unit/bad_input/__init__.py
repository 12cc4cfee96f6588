"""The bad-input catalogue: every input the project refuses, one row each, with what its message must say.

The promise: bad input (a config, data files, shapes, mesh sizes, checkpoint directories, a command line) is refused
with ONE line that names the value and what was expected, and nothing is lost or left half-written. A row is an id,
the error, a fragment of the message, and `provoke(tmp, monkeypatch)`, which sets the case up under `tmp` and returns
the call that must be refused. Every row is checked alike (the two checks of `catalogue.py`, which each module's
tests run): the call raises exactly the row's error, whose message holds the fragment on one line, and everything
under `tmp` is as the setup left it (a refused run removes the directories it made; an output directory keeps its
files, byte for byte). Command rows run a command's `main(argv)` in this process: exit status 2 and one line on
stderr (argparse's refusals: its usage lines, then one `error:` line).

One section per kind of input, in the order a run meets them, one module per area: config and config files
(`test_config.py`), mesh and launch options (`test_mesh_launch.py`), .bin shards, text sources and prepare
(`test_data.py`), checkpoints (`test_checkpoints.py`), a run's setup and its other files (`test_run.py`), then
generation and the commands: train.py, infer, compare, export, prepare (`test_commands.py`). A new refusal is one
more row in its section. Rows stay cheap: calls on tiny files and small pytrees; the rows that run `train` are
refused before its step is compiled.
"""
