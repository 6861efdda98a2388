"""Keep a command running: restart it whenever it exits, with backoff, and log every start and exit.

Under `ray up` (deploy/cluster*.yaml) the head runs `duospec serve` under this supervisor. It is
started with setsid + nohup so that it outlives the SSH command that launched it and no terminal
hang-up reaches it:

    setsid nohup python deploy/supervise.py --pidfile ~/duospec-serve.pid --log ~/duospec-serve.log -- \
        bash -c "python deploy/wait_for_gpus.py ... && exec duospec serve ..." >/dev/null 2>&1 </dev/null &

and stopped, before `ray stop` on every `ray up`, with

    python deploy/supervise.py --stop --pidfile ~/duospec-serve.pid

Restart delay: --min-backoff seconds after an exit, doubled for each further exit that comes within
--stable-after seconds of its start, at most --max-backoff; a run that lasted --stable-after starts
over at --min-backoff. So a crash on a healthy cluster is back within a second, and a server that
cannot start (Ray down, a broken config) retries about once a minute instead of spinning.

The command runs in its own process group with stdout and stderr appended to --log, next to the
supervisor's own lines. SIGTERM (or SIGINT, SIGHUP) to the supervisor is passed to that group
(`duospec serve` then drains its streams for server.grace_period_s); the group is killed if it is
still there after --stop-timeout, and the supervisor exits without restarting. Only the standard
library (Python 3.11 or newer, as on the image and the on-premises nodes).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

POLL_S = 0.05  # how often waits look at the stop flag: signals only set it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s --pidfile PATH (--log PATH [options] -- COMMAND... | --stop)")
    parser.add_argument("--pidfile", type=pathlib.Path, required=True,
                        help="the supervisor's pid, for --stop and to refuse a second supervisor")
    parser.add_argument("--log", type=pathlib.Path, help="file the command's output and the restarts are appended to")
    parser.add_argument("--stop", action="store_true", help="stop the supervisor named by --pidfile and its command")
    parser.add_argument("--min-backoff", type=_seconds, default=1.0, help="first restart delay, s (default 1)")
    parser.add_argument("--max-backoff", type=_seconds, default=60.0, help="longest restart delay, s (default 60)")
    parser.add_argument("--stable-after", type=_seconds, default=60.0,
                        help="a run this long resets the delay to --min-backoff, s (default 60)")
    parser.add_argument("--stop-timeout", type=_seconds, default=30.0,
                        help="how long the command may take to exit after SIGTERM before it is killed, s "
                             "(default 30: above duospec serve's 10 s drain)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value <= 86400.0:
        raise argparse.ArgumentTypeError(f"{text}: must be between 0 and 86400 seconds")
    return value


def log_line(log, message: str) -> None:
    log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} duospec-supervise[{os.getpid()}]: {message}\n")
    log.flush()


def next_backoff(previous: float | None, ran_s: float, args: argparse.Namespace) -> float:
    """The delay before the next start, given the last delay (None: no exit yet) and how long the run lasted."""
    if previous is None or ran_s >= args.stable_after:
        return args.min_backoff
    return min(args.max_backoff, max(args.min_backoff, previous * 2))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def running_supervisor(pidfile: pathlib.Path) -> int | None:
    """The pid in `pidfile` if that process is alive and is a supervisor (a reused pid is not)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if pathlib.Path(__file__).name.encode() in cmdline else None


class Supervisor:
    def __init__(self, args: argparse.Namespace, log):
        self.args, self.log = args, log
        self.stop_signal: int | None = None
        self.child: subprocess.Popen | None = None
        self.group: int | None = None  # the running command's process group; None between runs

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def request_stop(self, signum, _frame) -> None:
        # A handler may run in the middle of a log write: it only sets the flag and passes the signal on.
        self.stop_signal = signum
        self._signal_group(signal.SIGTERM)

    def run(self) -> int:
        backoff = None
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.args.command, stdin=subprocess.DEVNULL, stdout=self.log,
                                          stderr=self.log, process_group=0)
            self.group = self.child.pid
            log_line(self.log, f"started pid {self.child.pid}: {subprocess.list2cmdline(self.args.command)}")
            if self.stopping:  # a signal that came before self.group was set reached no group
                self._signal_group(signal.SIGTERM)
            returncode = self._wait_for_child()
            ran_s = time.monotonic() - started
            self._signal_group(signal.SIGKILL)  # whatever it left behind (a child of a `bash -c`)
            self.group = None  # its id may be reused once the group is empty
            outcome = f"pid {self.child.pid} {describe_exit(returncode)} after {ran_s:.1f} s"
            if not self.stopping:
                backoff = next_backoff(backoff, ran_s, self.args)
                log_line(self.log, f"{outcome}; restarting in {backoff:g} s")
                self._sleep(backoff)
            if self.stopping:
                log_line(self.log, f"{outcome}; {signal.Signals(self.stop_signal).name} received: not restarting")
                return 0

    def _wait_for_child(self) -> int:
        stop_deadline = None
        while (returncode := self.child.poll()) is None:
            if self.stopping and stop_deadline is None:
                stop_deadline = time.monotonic() + self.args.stop_timeout
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                log_line(self.log, f"pid {self.child.pid} still running {self.args.stop_timeout:g} s after "
                                   "SIGTERM; killing its process group")
                self._signal_group(signal.SIGKILL)
                return self.child.wait()
            time.sleep(POLL_S)
        return returncode

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def _signal_group(self, signum: int) -> None:
        if self.group is None:
            return
        try:
            os.killpg(self.group, signum)  # the child leads its own group (process_group=0)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


def stop(pidfile: pathlib.Path, timeout_s: float) -> int:
    pid = running_supervisor(pidfile)
    if pid is None:
        print(f"duospec-supervise: no supervisor running ({pidfile})", file=sys.stderr)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s + 5.0  # the supervisor itself kills its command at timeout_s
    # The supervisor removes its pidfile a moment before it exits: "stopped" waits for the process too.
    while running_supervisor(pidfile) == pid or not _exited(pid):
        if time.monotonic() > deadline:
            print(f"duospec-supervise: pid {pid} did not exit within {timeout_s + 5.0:g} s", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    print(f"duospec-supervise: stopped pid {pid}", file=sys.stderr)
    return 0


def _exited(pid: int) -> bool:
    """Whether process `pid` is gone, or has exited and waits only for its parent to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that pid: ours is gone
        return True
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stop:
        return stop(args.pidfile, args.stop_timeout)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command or args.log is None:
        parser.error("give --log and, after --, the command to keep running")
    if args.min_backoff > args.max_backoff:
        parser.error(f"--min-backoff {args.min_backoff:g} is above --max-backoff {args.max_backoff:g}")
    other = running_supervisor(args.pidfile)
    if other is not None:
        print(f"duospec-supervise: pid {other} already supervises ({args.pidfile}); stop it first with --stop",
              file=sys.stderr)
        return 1
    args.pidfile.write_text(f"{os.getpid()}\n")
    with open(args.log, "a", buffering=1) as log:
        supervisor = Supervisor(args, log)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, supervisor.request_stop)
        try:
            return supervisor.run()
        finally:
            if running_supervisor(args.pidfile) == os.getpid():
                args.pidfile.unlink()


if __name__ == "__main__":
    sys.exit(main())
