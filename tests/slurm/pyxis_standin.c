/*
 * pyxis STAND-IN: a SPANK plugin that accepts pyxis's options and runs no container.
 *
 * The test machines cannot install pyxis or enroot, so job scripts written for pyxis
 * (`srun --container-image=... --container-mounts=...`) are tested against this plugin. It
 * registers pyxis's option names, checks their syntax the way pyxis does (a bad value fails the
 * submission, in srun or sbatch, with a message naming the option), checks on the node that
 * path sources exist, and exports every given value into the task environment as
 * PYXIS_STANDIN_CONTAINER_<OPTION> (e.g. PYXIS_STANDIN_CONTAINER_IMAGE), so tests can see what a
 * job asked for. The task itself runs on the host, outside any container.
 *
 * Built by tests/slurm/cluster.sh against Debian's libslurm-dev (spank.h) into the cluster's
 * state directory, and loaded through its plugstack.conf. Written for tfdist; not pyxis's code.
 */

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

#define PREFIX "PYXIS_STANDIN_CONTAINER_"

/* One value-taking option: its name, the value given (NULL if none) and its check. */
struct value_opt {
	const char *name;
	const char *env;
	char *value;
	int (*check)(const char *value);
};

/* One on/off pair (--container-X / --no-container-X): -1 unset, 0 off, 1 on. */
struct flag_opt {
	const char *on;
	const char *off;
	const char *env;
	int value;
};

static int check_mounts(const char *value);
static int check_name(const char *value);
static int check_save(const char *value);
static int check_env_names(const char *value);
static int check_nonempty(const char *value);

enum { IMAGE, MOUNTS, WORKDIR, NAME, SAVE, ENV, NUM_VALUES };
static struct value_opt values[NUM_VALUES] = {
	[IMAGE] = {"container-image", PREFIX "IMAGE", NULL, check_nonempty},
	[MOUNTS] = {"container-mounts", PREFIX "MOUNTS", NULL, check_mounts},
	[WORKDIR] = {"container-workdir", PREFIX "WORKDIR", NULL, check_nonempty},
	[NAME] = {"container-name", PREFIX "NAME", NULL, check_name},
	[SAVE] = {"container-save", PREFIX "SAVE", NULL, check_save},
	[ENV] = {"container-env", PREFIX "ENV", NULL, check_env_names},
};

enum { MOUNT_HOME, REMAP_ROOT, ENTRYPOINT, ENTRYPOINT_LOG, WRITABLE, NUM_FLAGS };
static struct flag_opt flags[NUM_FLAGS] = {
	[MOUNT_HOME] = {"container-mount-home", "no-container-mount-home", PREFIX "MOUNT_HOME", -1},
	[REMAP_ROOT] = {"container-remap-root", "no-container-remap-root", PREFIX "REMAP_ROOT", -1},
	[ENTRYPOINT] = {"container-entrypoint", "no-container-entrypoint", PREFIX "ENTRYPOINT", -1},
	[ENTRYPOINT_LOG] = {"container-entrypoint-log", NULL, PREFIX "ENTRYPOINT_LOG", -1},
	[WRITABLE] = {"container-writable", "container-readonly", PREFIX "WRITABLE", -1},
};

/* enroot's mount flags, which pyxis passes on joined by "+". */
static const char *const mount_flags[] = {
	"ro", "rw", "bind", "rbind", "private", "rprivate", "slave", "rslave", "shared",
	"rshared", "nosuid", "suid", "nodev", "dev", "noexec", "exec", "noatime", "nodiratime",
	"relatime", "x-create=auto", "x-create=dir", "x-create=file", "x-detach", NULL,
};

static int is_path(const char *s)
{
	return s[0] == '/' || s[0] == '.';
}

static int check_nonempty(const char *value)
{
	return value[0] == '\0' ? -1 : 0;
}

static int check_mount_flags(const char *entry, char *list)
{
	char *flag;

	while ((flag = strsep(&list, "+")) != NULL) {
		int known = 0;
		for (int i = 0; mount_flags[i] != NULL; ++i)
			known |= strcmp(flag, mount_flags[i]) == 0;
		if (!known) {
			slurm_error("pyxis stand-in: --container-mounts=%s: unknown mount flag \"%s\" "
				    "(flags are joined with \"+\", e.g. SRC:DST:ro+rprivate)", entry, flag);
			return -1;
		}
	}
	return 0;
}

/* SRC[:DST[:FLAGS]], as pyxis parses it: SRC a path, "tmpfs" or "umount"; DST a path. */
static int check_mount(char *entry)
{
	char *copy = strdup(entry), *rest = copy;
	char *src = strsep(&rest, ":");
	char *dst = rest ? strsep(&rest, ":") : NULL;
	int rc = -1;

	if (src[0] == '\0' || (dst != NULL && dst[0] == '\0') || (rest && strchr(rest, ':'))) {
		slurm_error("pyxis stand-in: --container-mounts=%s: invalid format, expected "
			    "SRC:DST[:FLAGS] (several joined with \",\")", entry);
	} else if (!is_path(src) && strcmp(src, "tmpfs") != 0 && strcmp(src, "umount") != 0) {
		slurm_error("pyxis stand-in: --container-mounts=%s: the source must be a relative "
			    "or absolute path, \"tmpfs\" or \"umount\"", entry);
	} else if (dst != NULL && !is_path(dst)) {
		slurm_error("pyxis stand-in: --container-mounts=%s: the target must be a relative "
			    "or absolute path", entry);
	} else {
		rc = (rest && rest[0]) ? check_mount_flags(entry, rest) : 0;
	}
	free(copy);
	return rc;
}

static int check_mounts(const char *value)
{
	char *copy = strdup(value), *rest = copy, *entry;
	int rc = 0;

	while (rc == 0 && (entry = strsep(&rest, ",")) != NULL)
		rc = check_mount(entry);
	free(copy);
	return rc;
}

static int check_name(const char *value)
{
	const char *colon = strchr(value, ':');
	const char *how = colon ? colon + 1 : "auto";

	if (value[0] == ':' || value[0] == '\0') {
		slurm_error("pyxis stand-in: --container-name: empty name");
		return -1;
	}
	if (strcmp(how, "auto") && strcmp(how, "create") && strcmp(how, "exec") &&
	    strcmp(how, "no_exec") && how[0] != '\0') {
		slurm_error("pyxis stand-in: --container-name=%s: the flag after \":\" must be "
			    "auto, create, exec or no_exec", value);
		return -1;
	}
	return 0;
}

static int check_save(const char *value)
{
	if (value[strlen(value) - 1] == '/') {
		slurm_error("pyxis stand-in: --container-save=%s: the target is a directory, "
			    "expected a squashfs file path", value);
		return -1;
	}
	return 0;
}

static int check_env_names(const char *value)
{
	char *copy = strdup(value), *rest = copy, *name;
	int rc = 0;

	while (rc == 0 && (name = strsep(&rest, ",")) != NULL) {
		int ok = name[0] != '\0' && !isdigit((unsigned char)name[0]);
		for (const char *c = name; ok && *c; ++c)
			ok = isalnum((unsigned char)*c) || *c == '_';
		if (!ok) {
			slurm_error("pyxis stand-in: --container-env=%s: \"%s\" is not a variable "
				    "name (expected NAME[,NAME...])", value, name);
			rc = -1;
		}
	}
	free(copy);
	return rc;
}

static int on_value(int val, const char *optarg, int remote)
{
	struct value_opt *opt = &values[val];

	(void)remote;
	if (optarg == NULL || optarg[0] == '\0') {
		slurm_error("pyxis stand-in: --%s: argument required", opt->name);
		return -1;
	}
	/* Slurm may call a callback twice with the same value; only a different one is an error. */
	if (opt->value != NULL) {
		if (strcmp(opt->value, optarg) == 0)
			return 0;
		slurm_error("pyxis stand-in: --%s specified multiple times", opt->name);
		return -1;
	}
	if (opt->check(optarg) != 0) {
		slurm_error("pyxis stand-in: invalid --%s=%s", opt->name, optarg);
		return -1;
	}
	opt->value = strdup(optarg);
	return opt->value ? 0 : -1;
}

/* val encodes the flag index times two, plus one for the "on" spelling. */
static int on_flag(int val, const char *optarg, int remote)
{
	struct flag_opt *opt = &flags[val / 2];
	int on = val % 2;

	(void)optarg;
	(void)remote;
	if (opt->value != -1 && opt->value != on) {
		slurm_error("pyxis stand-in: both --%s and --%s were specified", opt->on, opt->off);
		return -1;
	}
	opt->value = on;
	return 0;
}

static int register_options(spank_t sp)
{
	static char usage[NUM_VALUES + 2 * NUM_FLAGS][160];
	struct spank_option opt;
	int n = 0;

	for (int i = 0; i < NUM_VALUES; ++i, ++n) {
		snprintf(usage[n], sizeof(usage[n]), "[pyxis stand-in: no container runs] exported "
			 "to tasks as %s", values[i].env);
		opt = (struct spank_option){(char *)values[i].name, "VALUE", usage[n], 1, i, on_value};
		if (spank_option_register(sp, &opt) != ESPANK_SUCCESS)
			return -1;
	}
	for (int i = 0; i < NUM_FLAGS; ++i) {
		for (int on = 1; on >= 0; --on, ++n) {
			const char *name = on ? flags[i].on : flags[i].off;
			if (name == NULL)
				continue;
			snprintf(usage[n], sizeof(usage[n]), "[pyxis stand-in: no container runs] "
				 "exported to tasks as %s=%d", flags[i].env, on);
			opt = (struct spank_option){(char *)name, NULL, usage[n], 0, 2 * i + on, on_flag};
			if (spank_option_register(sp, &opt) != ESPANK_SUCCESS)
				return -1;
		}
	}
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return register_options(sp);
}

/* On the node: a path that pyxis would bind or import must exist there. */
static int check_on_node(void)
{
	char *copy, *rest, *entry;
	int rc = 0;

	if (values[IMAGE].value && is_path(values[IMAGE].value) &&
	    access(values[IMAGE].value, R_OK) != 0) {
		slurm_error("pyxis stand-in: --container-image=%s: no such image file on this node "
			    "(%s)", values[IMAGE].value, strerror(errno));
		return -1;
	}
	if (values[MOUNTS].value == NULL)
		return 0;
	copy = strdup(values[MOUNTS].value);
	rest = copy;
	while (rc == 0 && (entry = strsep(&rest, ",")) != NULL) {
		char *src = strsep(&entry, ":");
		if (is_path(src) && access(src, F_OK) != 0) {
			slurm_error("pyxis stand-in: --container-mounts: source %s does not exist on "
				    "this node (%s)", src, strerror(errno));
			rc = -1;
		}
	}
	free(copy);
	return rc;
}

/* Runs in slurmstepd (batch step and every srun step) before the tasks start. */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	char number[2];

	(void)ac;
	(void)av;
	for (int i = 0; i < NUM_VALUES; ++i)
		if (values[i].value && spank_setenv(sp, values[i].env, values[i].value, 1))
			return -1;
	for (int i = 0; i < NUM_FLAGS; ++i) {
		if (flags[i].value == -1)
			continue;
		snprintf(number, sizeof(number), "%d", flags[i].value);
		if (spank_setenv(sp, flags[i].env, number, 1) != ESPANK_SUCCESS)
			return -1;
	}
	return 0;
}

/*
 * Runs in each task just before its program. A failure here ends the task with exit code 1,
 * so srun and the job fail; a failure in user_init would only print an error (srun exits 0).
 */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	return check_on_node();
}
