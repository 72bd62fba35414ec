"""Restart latency of an elastic job across hosts: two `zerorun launch --nnodes 1:2` launchers of 2 ranks on
loopback run the MLP example (checkpoint every 2 steps); after step 4, host 1's launcher and ranks are SIGKILLed, and
this prints the time from the kill to node 0's `resumed from step` line and to its first step at world size 2.
Run from the repository root after `cargo build --bins --examples` (debug build, as measured in the guide)."""
import subprocess, time, os, signal, random, shutil
root=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def run_once(trial):
    d=f'/tmp/el-lat-{trial}'; shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
    port=str(random.randint(20000,40000))
    def host(node):
        return subprocess.Popen([f'{root}/target/debug/zerorun','launch','--nnodes','1:2','--node-rank',str(node),'--nproc-per-node','2',
            '--master-port',port,'--max-restarts','1','--',f'{root}/target/debug/examples/mlp','--config',f'{root}/configs/zero2.json',
            '--steps','40','--checkpoint-dir',f'{d}/ck','--save-every','2','--resume','--slow-rank','0','--slow-ms','60'],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    n0, n1 = host(0), host(1)
    while not os.path.exists(f'{d}/ck/latest') or open(f'{d}/ck/latest').read().strip() < 'global_step4': time.sleep(0.005)
    kids=[int(p) for p in subprocess.run(['pgrep','-P',str(n1.pid)],capture_output=True,text=True).stdout.split()]
    t0=time.time()
    for p in kids+[n1.pid]: os.kill(p, signal.SIGKILL)
    resumed=first=None
    for line in n0.stdout:
        if resumed is None and 'resumed from step' in line: resumed=time.time()-t0
        if resumed is not None and line.startswith('[rank 0] step ') and first is None: first=time.time()-t0
    n0.wait(); n1.wait()
    return resumed, first
for t in range(3):
    r,f=run_once(t); print(f"trial {t}: kill -> resumed {r:.2f} s, -> first step at world size 2 {f if f is None else round(f,2)} s")
