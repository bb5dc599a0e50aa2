/*
 * libnearstore_fiemap.so: FS_IOC_FIEMAP on files of a nearstore mount, for tools that know
 * only FIEMAP (filefrag, a program building virtual objects from it).
 *
 * Linux answers FIEMAP in the VFS from the inode's fiemap operation, which FUSE lacks, so on
 * a nearstore mount the ioctl fails with EOPNOTSUPP before the mount sees it. Preloaded
 * (LD_PRELOAD), this library catches that failure on a file of a nearstore mount and
 * answers from the mount's own ioctl, NEARSTORE_IOC_EXTENTS (docs/fuse.md, "FIEMAP"), with
 * FIEMAP's semantics: the extents overlapping [fm_start, fm_start + fm_length), at most
 * fm_extent_count of them (none, only counted, when it is 0), each fe_physical the global
 * address of its bytes (device tag << 48 | byte offset in the namespace), fe_flags the source
 * file system's. The mount writes dirty pages back before it maps, so FIEMAP_FLAG_SYNC is
 * always honoured; FIEMAP_FLAG_XATTR is refused as the kernel refuses an unsupported flag
 * (EBADR, fm_flags set to it). Every other ioctl, and FIEMAP on any other file system, goes
 * to the C library untouched. A program that makes the system call itself (not through
 * ioctl(3)) or is linked statically is not reached.
 *
 * Build: cc -O2 -shared -fPIC -o libnearstore_fiemap.so nearstore_fiemap.c -ldl
 * Use:   LD_PRELOAD=$PWD/libnearstore_fiemap.so filefrag -v /mnt/view/app.log
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

/* docs/fuse.md: struct nearstore_extents, 4096 bytes, native byte order. */
#define NEARSTORE_IOC_EXTENTS 0xD0004E03UL
#define NEARSTORE_EXTENTS_VERSION 1
#define NEARSTORE_EXTENTS_PER_REPLY 119
#define FUSE_SUPER_MAGIC 0x65735546
/* Rounds of paging a file that changes under them before giving up with EAGAIN. */
#define CHANGED_RETRIES 3
/* The kernel's bound on fm_extent_count (fs/ioctl.c). */
#define FIEMAP_MAX_EXTENTS (UINT32_MAX / sizeof(struct fiemap_extent))

struct nearstore_extent {
    uint64_t logical, address, length;
    uint32_t flags, reserved;
};

struct nearstore_extents {
    uint32_t version, start, count, total;
    uint64_t size;
    uint32_t nsid;
    uint16_t tag, port;
    uint8_t addr[16];
    char nqn[224];
    uint8_t reserved[16];
    struct nearstore_extent extents[NEARSTORE_EXTENTS_PER_REPLY];
};

_Static_assert(sizeof(struct nearstore_extents) == 4096, "struct nearstore_extents is 4096 bytes");
_Static_assert(sizeof(struct fiemap_extent) == 56, "struct fiemap_extent is 56 bytes");

typedef int (*ioctl_fn)(int, unsigned long, void *);

/* The C library's ioctl, looked up once; threads racing to look it up store the same value. */
static ioctl_fn real_ioctl(void) {
    static ioctl_fn real;
    ioctl_fn f = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (!f) {
        f = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
        __atomic_store_n(&real, f, __ATOMIC_RELEASE);
    }
    return f;
}

/*
 * Whether fd's file lies on a nearstore mount (its type in /proc/self/mountinfo) whose FUSE
 * daemon is root's or this user's (the user_id= option): any user may mount a FUSE file system
 * of that type, and another FUSE file system may give NEARSTORE_IOC_EXTENTS's number another
 * meaning. The same rule as the host library's (crates/host/src/mount.rs, is_mount).
 */
static int on_nearstore_mount(int fd) {
    struct statfs fs;
    struct stat st;
    if (fstatfs(fd, &fs) != 0 || fs.f_type != FUSE_SUPER_MAGIC || fstat(fd, &st) != 0)
        return 0;
    char dev[32];
    snprintf(dev, sizeof dev, "%u:%u", major(st.st_dev), minor(st.st_dev));
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f)
        return 0;
    char *line = NULL;
    size_t cap = 0;
    int found = 0;
    uid_t me = geteuid();
    while (!found && getline(&line, &cap, f) > 0) {
        /* ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER_OPTIONS */
        char *sep = strstr(line, " - ");
        if (!sep)
            continue;
        *sep = '\0';
        char *save, *field = strtok_r(line, " ", &save);
        for (int i = 0; field && i < 2; i++)
            field = strtok_r(NULL, " ", &save);
        if (!field || strcmp(field, dev) != 0)
            continue;
        char *type = strtok_r(sep + 3, " \n", &save);
        char *source = type ? strtok_r(NULL, " \n", &save) : NULL;
        char *options = source ? strtok_r(NULL, " \n", &save) : NULL;
        if (!type || strcmp(type, "fuse.nearstore") != 0 || !options)
            continue;
        for (char *o = strtok_r(options, ",", &save); o; o = strtok_r(NULL, ",", &save)) {
            unsigned long owner;
            char end;
            if (sscanf(o, "user_id=%lu%c", &owner, &end) == 1 && (owner == 0 || owner == me))
                found = 1;
        }
    }
    free(line);
    fclose(f);
    return found;
}

/* One reply of the mount from extent index `start`; -1 with errno on failure. */
static int ask(int fd, uint32_t start, struct nearstore_extents *r) {
    memset(r, 0, sizeof *r);
    r->version = NEARSTORE_EXTENTS_VERSION;
    r->start = start;
    ioctl_fn real = real_ioctl();
    if (!real || real(fd, NEARSTORE_IOC_EXTENTS, r) != 0)
        return -1;
    if (r->count > NEARSTORE_EXTENTS_PER_REPLY) {
        errno = EIO; /* more than a reply holds: no partial map */
        return -1;
    }
    return 0;
}

/* Whether reply `r`, asked from `start`, is a page of the file whose total it gives. */
static int consistent(const struct nearstore_extents *r, uint32_t start) {
    return r->start == start && start <= r->total && r->count <= r->total - start && (r->count > 0 || start == r->total);
}

/* FIEMAP answered from the mount's extents; 0, or -1 with errno. */
static int fiemap_from_mount(int fd, struct fiemap *fm) {
    /* In ioctl_fiemap's order: the count, the range, then the flags; no extent mapped on
       any error. */
    fm->fm_mapped_extents = 0;
    if (fm->fm_extent_count > FIEMAP_MAX_EXTENTS || fm->fm_length == 0) {
        errno = EINVAL;
        return -1;
    }
    if (fm->fm_flags & ~(uint32_t)FIEMAP_FLAG_SYNC) {
        fm->fm_flags &= ~(uint32_t)FIEMAP_FLAG_SYNC;
        errno = EBADR;
        return -1;
    }
    uint64_t from = fm->fm_start;
    uint64_t to = fm->fm_length > UINT64_MAX - from ? UINT64_MAX : from + fm->fm_length;
    struct nearstore_extents *r = malloc(sizeof *r);
    if (!r) {
        errno = ENOMEM;
        return -1;
    }
    int rc = -1;
    for (int round = 0; round < CHANGED_RETRIES; round++) {
        uint32_t mapped = 0, start = 0, total = 0;
        uint64_t size = 0;
        int changed = 0, full = 0;
        do {
            if (ask(fd, start, r) != 0) {
                /* The mount has no extents to give for this file (a directory, a result
                   file, no exported namespace, an older mount): FIEMAP's "not here". */
                if (start == 0 && (errno == ENOTTY || errno == EISDIR || errno == EINVAL || errno == ENODEV))
                    errno = EOPNOTSUPP;
                goto out;
            }
            if (start == 0) {
                total = r->total;
                size = r->size;
            } else if (r->total != total || r->size != size) {
                changed = 1;
                break;
            }
            if (!consistent(r, start)) {
                errno = EIO; /* a reply that contradicts itself: no partial map */
                goto out;
            }
            for (uint32_t i = 0; i < r->count && !full; i++) {
                const struct nearstore_extent *e = &r->extents[i];
                if (e->logical + e->length <= from || e->logical >= to)
                    continue;
                if (fm->fm_extent_count == 0) {
                    mapped++;
                    continue;
                }
                if (mapped == fm->fm_extent_count) {
                    full = 1;
                    break;
                }
                struct fiemap_extent *out = &fm->fm_extents[mapped++];
                memset(out, 0, sizeof *out);
                out->fe_logical = e->logical;
                out->fe_physical = e->address;
                out->fe_length = e->length;
                out->fe_flags = e->flags;
            }
            start += r->count;
        } while (start < total && !full && !(r->count && r->extents[r->count - 1].logical >= to));
        if (changed)
            continue;
        fm->fm_mapped_extents = mapped;
        rc = 0;
        goto out;
    }
    errno = EAGAIN; /* the file kept changing while its extents were read */
out:
    if (rc != 0)
        fm->fm_mapped_extents = 0;
    free(r);
    return rc;
}

int ioctl(int fd, unsigned long request, ...) {
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    ioctl_fn real = real_ioctl();
    if (!real) {
        errno = ENOSYS;
        return -1;
    }
    int rc = real(fd, request, arg);
    /* The kernel takes the request's low 32 bits (a caller's int may come sign-extended). */
    if (rc == 0 || (unsigned int)request != FS_IOC_FIEMAP || errno != EOPNOTSUPP || !arg)
        return rc;
    int saved = errno;
    if (!on_nearstore_mount(fd)) {
        errno = saved;
        return rc;
    }
    return fiemap_from_mount(fd, (struct fiemap *)arg);
}
