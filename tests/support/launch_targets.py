"""Entry points for launcher tests: module-level functions a forked process runs."""

import ctypes
import os
import sys
import time


def echo(spec):
    print(f"hello from {spec.key} pid={os.getpid()}")
    print("to stderr", file=sys.stderr)
    return 0


def raise_error(spec):
    raise ValueError("boom in " + spec.key)


def exit_3(spec):
    sys.exit(3)


def segfault(spec):
    ctypes.string_at(0)


def big_output(spec):
    sys.stdout.write("x" * (10 * 1024 * 1024) + "\n")
    return 0


def hang(spec):
    while True:
        time.sleep(1)


def hang_with_child(spec):
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"child {child.pid}", flush=True)
    while True:
        time.sleep(1)


def ignore_sigterm(spec):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        time.sleep(1)


def env_and_cwd(spec):
    print(os.environ.get("TAAS_TEST_VALUE"), os.getcwd(), os.getpgid(0) == os.getpid())
    return 0


def args_size(spec):
    print(len(spec.args[0]))
    return 0


# -- LaunchSpec.cleanups hooks: run in the start process ----------------------------------------
def touch(path):
    with open(path, "w"):
        pass


def failing_hook():
    raise RuntimeError("a hook that fails must not stop the others")


# -- a placed rendezvous (taas.launch.ray.agent): torchrun's env given, the store elsewhere ------
def rendezvous_sum(spec):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "TAAS_NODE_ID", "GLOO_SOCKET_IFNAME")
    print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), f"sum={t.item():g}",
          "job_dir" if os.path.isdir(os.environ["TAAS_JOB_DIR"]) else "no-job-dir", flush=True)
    dist.destroy_process_group()
    return 0


def read_shared(spec):
    fds = [int(fd) for fd in os.environ["TAAS_SHARED_FDS"].split(",") if fd]
    print(b"|".join(os.pread(fd, 100, 0) for fd in fds).decode())
    return 0


def show_gpus_then_hang(spec):
    """A rank of a job with a GPU lease: the GPUs it sees, how many shared fds it holds."""
    print(os.environ.get("CUDA_VISIBLE_DEVICES", "-"), os.environ.get("LOCAL_RANK", "-"),
          len([fd for fd in os.environ.get("TAAS_SHARED_FDS", "").split(",") if fd]), flush=True)
    while True:
        time.sleep(1)


def kept_rank_whose_main_thread_ends(spec):
    """A kept rank caught as it dies: its FIFO open for reading (cells.Inbox) and held by
    another thread, while its main thread has ended (what a SIGKILLed many-threaded rank
    looks like for a moment: a zombie leader whose other threads still hold its files)."""
    import threading

    from taas.launch.process import cells

    inbox = cells.Inbox(os.environ["TAAS_JOB_DIR"], spec.key)
    threading.Thread(target=lambda: (time.sleep(600), os.close(inbox.fd))).start()
    print("up", flush=True)
    ctypes.CDLL(None).pthread_exit(None)


def hang_and_say_pid(spec):
    """Write this process's pid to ``$TAAS_TEST_PIDS/<key>``, then hang."""
    path = os.path.join(os.environ["TAAS_TEST_PIDS"], spec.key)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(1)
