/*
 * The test guest's /init: a static, libc-free program that prints a
 * marker on the console, counts the processors in /proc/cpuinfo, prints
 * that count and powers the VM off. Built by crates/testkit with
 * `cc -static -nostdlib -ffreestanding -O2`.
 *
 * The kernel passes unknown `key=value` command line parameters to init as
 * environment variables; `tine_init_action=` picks how init ends:
 *   poweroff (default)  reboot(LINUX_REBOOT_CMD_POWER_OFF)
 *   reset               reboot(LINUX_REBOOT_CMD_RESTART): with reboot=k,
 *                       an i8042 CPU reset
 *   exit                return from init: the kernel panics
 * and `tine_init_disk=/dev/vdX` adds a disk check: write a 4 KiB pattern
 * at byte 4096 of that disk, fsync, read it back and compare, and print the
 * disk's serial (virtio-blk GET_ID) from /sys/block/vdX/serial;
 * and `tine_init_vsock=<port>` adds a vsock exchange: listen on that
 * AF_VSOCK port, accept one connection, then
 *   1. read a u64 (little endian) N, then N bytes, checking each against
 *      host_pattern(i);
 *   2. send N bytes of guest_pattern(i);
 *   3. read a u64 M, then M times: read 1 byte and send it back;
 *   4. wait for the host to close (so that every byte sent reached it
 *      before init goes on and powers the VM off), then close.
 *
 * Console lines (the tests match them):
 *   TINE-INIT-MARKER ready
 *   TINE-INIT-CPUINFO processors=<n> bytes=<m>
 *   TINE-INIT-DISK ok serial=<serial>   (with tine_init_disk)
 *   TINE-INIT-VSOCK listening           (with tine_init_vsock)
 *   TINE-INIT-VSOCK ok bytes=<N> pings=<M>
 *   TINE-INIT-ERROR <step> <errno>      (then it spins; the test fails)
 */
#define SYS_read 0
#define SYS_write 1
#define SYS_open 2
#define SYS_close 3
#define SYS_ioctl 16
#define TCSBRK 0x5409
#define SYS_pread64 17
#define SYS_pwrite64 18
#define SYS_fsync 74
#define SYS_mount 165
#define O_RDWR 2
#define SYS_socket 41
#define SYS_accept 43
#define SYS_bind 49
#define SYS_listen 50
#define AF_VSOCK 40
#define SOCK_STREAM 1
#define SYS_reboot 169

#define LINUX_REBOOT_MAGIC1 0xfee1dead
#define LINUX_REBOOT_MAGIC2 672274793
#define LINUX_REBOOT_CMD_POWER_OFF 0x4321fedc
#define LINUX_REBOOT_CMD_RESTART 0x01234567
#define SYS_exit 60

static long syscall5(long n, long a, long b, long c, long d, long e)
{
	long ret;
	register long r10 __asm__("r10") = d;
	register long r8 __asm__("r8") = e;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
			 : "rcx", "r11", "memory");
	return ret;
}

static long len(const char *s)
{
	long n = 0;
	while (s[n])
		n++;
	return n;
}

static void put(const char *s)
{
	syscall5(SYS_write, 1, (long)s, len(s), 0, 0);
}

/*
 * Waits until the console has sent what init wrote (tcdrain: TCSBRK with a
 * non-zero argument, tty_ioctl(4)). The serial driver sends from a buffer
 * on interrupts; a kernel panic or a power off right after a write would
 * otherwise cut the last lines off.
 */
static void drain(void)
{
	syscall5(SYS_ioctl, 1, TCSBRK, 1, 0, 0);
}

static void put_num(unsigned long v)
{
	char buf[24];
	int i = sizeof(buf) - 1;
	buf[i] = 0;
	do {
		buf[--i] = '0' + v % 10;
		v /= 10;
	} while (v && i > 0);
	put(&buf[i]);
}

static void fail(const char *step, long err)
{
	put("TINE-INIT-ERROR ");
	put(step);
	put(" ");
	put_num(-err);
	put("\n");
	for (;;)
		;
}

static char buf[65536];

/* The value of environment variable `name` in `envp`, or 0. */
static const char *getenv_in(char **envp, const char *name)
{
	for (; *envp; envp++) {
		const char *e = *envp, *n = name;
		while (*n && *e == *n) {
			e++;
			n++;
		}
		if (!*n && *e == '=')
			return e + 1;
	}
	return 0;
}

static int streq(const char *a, const char *b)
{
	while (*a && *a == *b) {
		a++;
		b++;
	}
	return *a == *b;
}

static char pattern[4096], back[4096], path[64];

static void disk_check(const char *dev)
{
	long fd, r, i, n;
	const char *name = dev;

	for (i = 0; i < 4096; i++)
		pattern[i] = (char)(i * 13 + 7);
	fd = syscall5(SYS_open, (long)dev, O_RDWR, 0, 0, 0);
	if (fd < 0)
		fail("disk-open", fd);
	r = syscall5(SYS_pwrite64, fd, (long)pattern, 4096, 4096, 0);
	if (r != 4096)
		fail("disk-write", r < 0 ? r : -1);
	r = syscall5(SYS_fsync, fd, 0, 0, 0, 0);
	if (r < 0)
		fail("disk-fsync", r);
	r = syscall5(SYS_pread64, fd, (long)back, 4096, 4096, 0);
	if (r != 4096)
		fail("disk-read", r < 0 ? r : -1);
	for (i = 0; i < 4096; i++)
		if (back[i] != pattern[i])
			fail("disk-compare", -1);
	syscall5(SYS_close, fd, 0, 0, 0, 0);

	/* /sys/block/<name>/serial, name = dev without "/dev/" */
	for (i = 0; dev[i]; i++)
		if (dev[i] == '/')
			name = dev + i + 1;
	r = syscall5(SYS_mount, (long)"sysfs", (long)"/sys", (long)"sysfs", 0, 0);
	if (r < 0)
		fail("mount-sys", r);
	n = 0;
	for (const char *p = "/sys/block/"; *p; p++)
		path[n++] = *p;
	for (const char *p = name; *p && n < 40; p++)
		path[n++] = *p;
	for (const char *p = "/serial"; *p; p++)
		path[n++] = *p;
	path[n] = 0;
	fd = syscall5(SYS_open, (long)path, 0, 0, 0, 0);
	if (fd < 0)
		fail("serial-open", fd);
	r = syscall5(SYS_read, fd, (long)back, 64, 0, 0);
	if (r < 0)
		fail("serial-read", r);
	back[r] = 0;
	if (r > 0 && back[r - 1] == '\n')
		back[r - 1] = 0;
	put("TINE-INIT-DISK ok serial=");
	put(back);
	put("\n");
}

/* The byte patterns of the vsock exchange (the host test has the same). */
static unsigned char host_pattern(unsigned long i)
{
	return (unsigned char)(i * 31 + (i >> 9));
}

static unsigned char guest_pattern(unsigned long i)
{
	return (unsigned char)(i * 17 + (i >> 11) + 5);
}

static void read_full(long fd, char *p, long n, const char *step)
{
	while (n > 0) {
		long r = syscall5(SYS_read, fd, (long)p, n, 0, 0);
		if (r <= 0)
			fail(step, r < 0 ? r : -1);
		p += r;
		n -= r;
	}
}

static void write_full(long fd, const char *p, long n, const char *step)
{
	while (n > 0) {
		long r = syscall5(SYS_write, fd, (long)p, n, 0, 0);
		if (r <= 0)
			fail(step, r < 0 ? r : -1);
		p += r;
		n -= r;
	}
}

static unsigned long parse_num(const char *s)
{
	unsigned long v = 0;
	while (*s >= '0' && *s <= '9')
		v = v * 10 + (unsigned long)(*s++ - '0');
	return v;
}

static void vsock_exchange(unsigned long port)
{
	struct {
		unsigned short family, reserved;
		unsigned int port, cid;
		unsigned char flags, zero[3];
	} addr = { AF_VSOCK, 0, (unsigned int)port, 0xffffffffu, 0, { 0, 0, 0 } };
	unsigned long n, m, i, off;
	long lfd, fd, r;

	lfd = syscall5(SYS_socket, AF_VSOCK, SOCK_STREAM, 0, 0, 0);
	if (lfd < 0)
		fail("vsock-socket", lfd);
	r = syscall5(SYS_bind, lfd, (long)&addr, sizeof(addr), 0, 0);
	if (r < 0)
		fail("vsock-bind", r);
	r = syscall5(SYS_listen, lfd, 1, 0, 0, 0);
	if (r < 0)
		fail("vsock-listen", r);
	put("TINE-INIT-VSOCK listening\n");
	fd = syscall5(SYS_accept, lfd, 0, 0, 0, 0);
	if (fd < 0)
		fail("vsock-accept", fd);

	read_full(fd, (char *)&n, 8, "vsock-read-n");
	for (off = 0; off < n;) {
		long chunk = n - off > sizeof(buf) ? (long)sizeof(buf) : (long)(n - off);
		r = syscall5(SYS_read, fd, (long)buf, chunk, 0, 0);
		if (r <= 0)
			fail("vsock-read", r < 0 ? r : -1);
		for (i = 0; i < (unsigned long)r; i++)
			if ((unsigned char)buf[i] != host_pattern(off + i))
				fail("vsock-compare", -1);
		off += (unsigned long)r;
	}
	for (off = 0; off < n;) {
		long chunk = n - off > sizeof(buf) ? (long)sizeof(buf) : (long)(n - off);
		for (i = 0; i < (unsigned long)chunk; i++)
			buf[i] = (char)guest_pattern(off + i);
		write_full(fd, buf, chunk, "vsock-write");
		off += (unsigned long)chunk;
	}
	read_full(fd, (char *)&m, 8, "vsock-read-m");
	for (i = 0; i < m; i++) {
		read_full(fd, buf, 1, "vsock-ping");
		write_full(fd, buf, 1, "vsock-pong");
	}
	r = syscall5(SYS_read, fd, (long)buf, 1, 0, 0);
	if (r != 0)
		fail("vsock-eof", r < 0 ? r : -1);
	syscall5(SYS_close, fd, 0, 0, 0, 0);
	syscall5(SYS_close, lfd, 0, 0, 0, 0);
	put("TINE-INIT-VSOCK ok bytes=");
	put_num(n);
	put(" pings=");
	put_num(m);
	put("\n");
}

/* Called from _start with the initial stack: argc, argv..., 0, envp..., 0. */
__attribute__((used)) void start_c(long *sp)
{
	long r, fd, total = 0, processors = 0;
	long argc = sp[0];
	char **envp = (char **)(sp + argc + 2);
	const char *action = getenv_in(envp, "tine_init_action");
	const char *disk = getenv_in(envp, "tine_init_disk");
	const char *vsock = getenv_in(envp, "tine_init_vsock");
	long cmd = LINUX_REBOOT_CMD_POWER_OFF;

	put("TINE-INIT-MARKER ready\n");
	r = syscall5(SYS_mount, (long)"proc", (long)"/proc", (long)"proc", 0, 0);
	if (r < 0)
		fail("mount", r);
	fd = syscall5(SYS_open, (long)"/proc/cpuinfo", 0, 0, 0, 0);
	if (fd < 0)
		fail("open", fd);
	for (;;) {
		r = syscall5(SYS_read, fd, (long)buf, sizeof(buf), 0, 0);
		if (r < 0)
			fail("read", r);
		if (r == 0)
			break;
		/* Count lines that start with "processor". */
		for (long i = 0; i < r; i++) {
			if ((total + i == 0 || (i > 0 && buf[i - 1] == '\n')) &&
			    i + 9 <= r && buf[i] == 'p' && buf[i + 1] == 'r' &&
			    buf[i + 2] == 'o' && buf[i + 3] == 'c' && buf[i + 8] == 'r')
				processors++;
		}
		total += r;
	}
	syscall5(SYS_close, fd, 0, 0, 0, 0);
	put("TINE-INIT-CPUINFO processors=");
	put_num(processors);
	put(" bytes=");
	put_num(total);
	put("\n");
	if (disk)
		disk_check(disk);
	if (vsock)
		vsock_exchange(parse_num(vsock));
	if (action && streq(action, "exit")) {
		put("TINE-INIT-EXIT\n");
		drain();
		syscall5(SYS_exit, 0, 0, 0, 0, 0);
	}
	if (action && streq(action, "reset"))
		cmd = LINUX_REBOOT_CMD_RESTART;
	drain();
	r = syscall5(SYS_reboot, LINUX_REBOOT_MAGIC1, LINUX_REBOOT_MAGIC2, cmd, 0, 0);
	fail("reboot", r);
}

/* The entry point: pass the initial stack pointer to start_c, aligned. */
__asm__(".globl _start\n"
	"_start:\n"
	"	mov %rsp, %rdi\n"
	"	and $-16, %rsp\n"
	"	call start_c\n"
	"	hlt\n");
