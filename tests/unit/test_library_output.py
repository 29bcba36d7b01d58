"""Where `tokenmill run` sends library output (pipeline/cli/liblog.py): tokenmill's own lines to the terminal, the
engines' and libraries' messages to a log file, whichever way they are written."""

import logging
import os
import subprocess
import sys
import warnings

from pipeline.cli.liblog import library_output

# A child process writing to its inherited descriptors, as vLLM's engine core and torch's C++ code do.
CHILD = "import os, sys; os.write(2, b'engine core: C++ warning\\n'); print('engine core: on stdout', flush=True)"


def test_library_messages_go_to_the_file_and_tokenmill_lines_to_the_terminal(tmp_path, capfd):
    # A library logger that propagates (vLLM's, once vllm is imported in the process, has its own handler on the
    # stream it found then, whose descriptor goes to the file: the fd lines below stand for it).
    with library_output(tmp_path, verbose=False) as path:
        logging.getLogger("tokenmill.progress").info("progress: 3/10 items done")
        logging.getLogger("somelib.engine").warning("Passing raw prompts is deprecated")
        warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning, stacklevel=1)
        os.write(2, b"W1203 triton.py:53] Triton not available\n")
        subprocess.run([sys.executable, "-c", CHILD], check=True)
        print("the job summary", flush=True)
    terminal = capfd.readouterr()
    logged = path.read_text()
    assert path.parent == tmp_path / "logs" and path.name.startswith("run-")
    assert "progress: 3/10 items done" in terminal.err and "the job summary" in terminal.out
    for line in (
        "Passing raw prompts is deprecated",
        "reduce_op is deprecated",
        "Triton not available",
        "engine core: C++ warning",
        "engine core: on stdout",
    ):
        assert line in logged and line not in terminal.err + terminal.out, line
    assert "progress: 3/10" not in logged
    # Afterwards the descriptors are the terminal's again.
    os.write(2, b"after the block\n")
    assert "after the block" in capfd.readouterr().err


def test_verbose_keeps_everything_on_the_terminal(tmp_path, capfd):
    with library_output(tmp_path, verbose=True) as path:
        logging.getLogger("somelib.engine").warning("Passing raw prompts is deprecated")
        os.write(2, b"Triton not available\n")
    err = capfd.readouterr().err
    assert path is None and "Passing raw prompts" in err and "Triton not available" in err
    assert not (tmp_path / "logs").exists()


# A process of its own, its descriptors 1 and 2 pipes as under cron or Airflow: the terminal streams are new ones on
# copies of those descriptors (under pytest's capture the streams are not descriptors 1 and 2).
OWN_PROCESS = """
import logging, os, sys
from pathlib import Path
from pipeline.cli.liblog import library_output
with library_output(Path(sys.argv[1]), verbose=False) as path:
    logging.getLogger("tokenmill.progress").info("progress: ours")
    logging.getLogger("tokenmill.run").warning("no embedding model at " + "/a-long-folder" * 12)
    print("the job summary")
    os.write(1, b"engine core on fd 1\\n")
    os.write(2, b"engine core on fd 2\\n")
    # A library that sets up its own handler when first imported, during the job (torch's logging does).
    own = logging.getLogger("somelib.compile")
    own.propagate = False
    own.addHandler(logging.StreamHandler())
    own.warning("engine core: Triton not available")
print("after", path.read_text().count("engine core"))
"""


def test_in_a_process_of_its_own_the_terminal_keeps_tokenmill_and_the_file_the_rest(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", OWN_PROCESS, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert "progress: ours" in done.stderr and "engine core" not in done.stderr
    assert done.stdout.splitlines() == ["the job summary", "after 3"]
    # tokenmill's own lines fit 100 columns, a long path continued on indented lines
    assert all(len(line) <= 100 for line in done.stderr.splitlines()) and "/a-long-folder" in done.stderr
    assert any(line.startswith("    ") for line in done.stderr.splitlines())
