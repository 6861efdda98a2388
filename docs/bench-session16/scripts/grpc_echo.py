"""A gRPC bidi-stream echo between two plain processes (aio client, sync server like the workers'): the
transport's own round trip on this machine, to compare with a verify round's overhead (trace.py).

    python docs/bench-session16/scripts/grpc_echo.py client
"""
import grpc, time, asyncio, sys, statistics, subprocess, os
from concurrent import futures
def handler_sync(request_iterator, context):
    for req in request_iterator:
        yield req
if sys.argv[1] == "server":
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    h = grpc.method_handlers_generic_handler("svc", {"Echo": grpc.stream_stream_rpc_method_handler(handler_sync)})
    server.add_generic_rpc_handlers((h,))
    port = server.add_insecure_port("127.0.0.1:0"); server.start(); print(port, flush=True); server.wait_for_termination()
else:
    p = subprocess.Popen([sys.executable, __file__, "server"], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    async def main(style):
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        payload = b"x" * 200
        ts = []
        if style == "write":
            call = ch.stream_stream("/svc/Echo")()
            for i in range(2000):
                t0 = time.perf_counter(); await call.write(payload); await call.read(); ts.append(time.perf_counter() - t0)
        else:
            q = asyncio.Queue()
            async def reqs():
                while True:
                    yield await q.get()
            call = ch.stream_stream("/svc/Echo")(reqs())
            it = call.__aiter__()
            for i in range(2000):
                t0 = time.perf_counter(); q.put_nowait(payload); await it.__anext__(); ts.append(time.perf_counter() - t0)
        print(style, "cross-process round trip median ms %.3f" % (statistics.median(ts[300:]) * 1e3))
        call.cancel(); await ch.close()
    asyncio.run(main("write")); asyncio.run(main("iter"))
    p.kill()
