"""The worker processes of ranks 1..N-1: started by the executor with spawn, fed every step's
StepInputs through shared memory and a pipe (step_channel.py), watched so that a dead one is an
error instead of a hang.

Besides steps, a pipe carries calls (WorkerCall): a method of the rank's Worker to run with its
arguments, answered with ("ok", result) or ("error", traceback). Rank 0 makes the same call on its
own worker (Executor.collective_rpc), so a call that holds a collective meets on every rank."""
import contextlib
import multiprocessing as mp
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.step import StepInputs
from nanovllm.executor.step_channel import StepChannel, slot_words
from nanovllm.worker.worker import GROUP_TIMEOUT, Worker

LOADED = "loaded"
# NVLink multicast (NVLS) stays off on every rank: on shared machines a multicast object can take the
# host's GPUs out of service. Set in rank 0's process before any other rank starts, so they inherit it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class WorkerCall:
    """Run `getattr(worker, method)(*args, **kwargs)` on a rank and answer with its result."""
    method: str
    args: tuple = ()
    kwargs: dict | None = None


@dataclass
class WorkerProcess:
    """Rank 0's handle on a worker process, its pipe and the shared memory that carry its steps."""
    rank: int
    process: mp.Process
    conn: Connection
    channel: StepChannel
    name: str = ""     # how errors name the rank

    def __post_init__(self):
        self.name = self.name or f"tensor-parallel worker {self.rank}"

    def check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"{self.name} died (exit code {self.process.exitcode}); "
                               "this engine cannot continue, shut it down and start a new one")

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the rank to end (a collective failing may mean it died)."""
        self.process.join(timeout=timeout)

    def kill(self) -> None:
        self.process.kill()

    @property
    def exited_cleanly(self) -> bool:
        return self.process.exitcode == 0

    def send(self, message: StepInputs | WorkerCall) -> None:
        self.check_alive()
        self.channel.send(self.conn, message, self.check_alive)

    def answer(self) -> tuple[str, object]:
        """("ok", result) of the WorkerCall sent last, or ("error", the rank's traceback)."""
        while not self.conn.poll(0.05):
            self.check_alive()
        return self.conn.recv()

    def expect(self, message: str) -> None:
        while not self.conn.poll(0.05):
            self.check_alive()
        received = self.conn.recv()
        if received != message:
            raise RuntimeError(f"{self.name} failed to start:\n{received}")


def open_rendezvous(host: str) -> dist.TCPStore:
    """The store the ranks form their process group on, listening on `host` before any of them starts.
    Rank 0 forms the group on this very store and the others connect to it (join_rendezvous): nothing
    listens twice. A port found free and let go, or listened on again by rank 0 (torch's reuse of a
    server in its process is keyed by port and misses when the port was an earlier server's), can be
    taken in between: EADDRINUSE, or ranks meeting a stranger's store."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)


def join_rendezvous(address: tuple[str, int]) -> dist.TCPStore:
    """A worker rank's connection to rank 0's store at (host, port)."""
    host, port = address
    return dist.TCPStore(host, port, is_master=False, timeout=GROUP_TIMEOUT)


def start_worker_processes(config: Config, multi_token_len: int | None = None
                           ) -> tuple[dist.TCPStore, list[WorkerProcess]]:
    """Ranks 1.. of `config`, each a Worker in a process of its own; and the store they meet rank 0 at
    (open_rendezvous)."""
    rendezvous = open_rendezvous("127.0.0.1")
    context = mp.get_context("spawn")
    workers = []
    tp = config.tensor_parallel_size
    for rank in range(1, config.world_size):
        parent_end, child_end = context.Pipe()
        channel = StepChannel.create(context, slot_words(config))
        process = context.Process(target=worker_main,
                                  args=(config, rank, (rendezvous.host, rendezvous.port), multi_token_len,
                                        child_end, channel),
                                  name=f"nanovllm-rank{rank}", daemon=True)
        process.start()
        child_end.close()
        stage, tp_rank = divmod(rank, tp)
        name = "" if config.pipeline_parallel_size == 1 else \
            f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"
        workers.append(WorkerProcess(rank, process, parent_end, channel, name))
    return rendezvous, workers


def stop_worker_processes(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
    for worker in workers:
        worker.process.join(timeout=30)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
        worker.channel.unlink()


def worker_main(config: Config, rank: int, rendezvous: tuple[str, int], multi_token_len: int | None,
                conn: Connection, channel: StepChannel) -> None:
    """A worker rank: build the same model shard, then run every step rank 0 sends until told to stop."""
    try:
        worker = Worker(config, rank, join_rendezvous(rendezvous), multi_token_len)
        conn.send(LOADED)        # before the first collective, which would hang on a dead rank
        worker.init_kv_cache()
    except BaseException:
        conn.send(traceback.format_exc())
        return
    try:
        while (message := channel.receive(conn)) is not None:
            if isinstance(message, WorkerCall):
                try:
                    conn.send(("ok", getattr(worker, message.method)(*message.args, **(message.kwargs or {}))))
                except Exception:
                    conn.send(("error", traceback.format_exc()))
            else:
                worker.run(message)
    except EOFError:                      # rank 0's process is gone
        pass
    finally:
        channel.close()
        worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def deferred_keyboard_interrupt():
    """Hold back a Ctrl-C (SIGINT) until the block ends, then raise it. Only the main thread gets
    signals, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, None)
