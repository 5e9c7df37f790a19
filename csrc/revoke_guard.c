/* See revoke_guard.h. */
#define _GNU_SOURCE
#include "revoke_guard.h"

#include <dlfcn.h>
#include <link.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ulfm_compat.h"

#define C_COLL 0x158          /* offsetof(ompi_communicator_t, c_coll) in this build */
#define COLL_REVOKE 0x450     /* offsetof(mca_coll_base_comm_coll_t, coll_revoke_local) */
#define KNOWN_AT 0x35         /* where ompi_comm_revoke_local makes that call */

/* mov C_COLL(%rbx),%rax; mov %rbx,%rdi; call *COLL_REVOKE(%rax): the code the offsets above belong to. */
static const unsigned char KNOWN[] = {0x48, 0x8b, 0x83, 0x58, 0x01, 0x00, 0x00, 0x48, 0x89, 0xdf,
                                      0xff, 0x90, 0x50, 0x04, 0x00, 0x00};

typedef bool (*revoke_fn)(void *comm, bool coll_only);
static revoke_fn real_revoke;
static void **entry;          /* libmpi's entry for ompi_comm_revoke_local, once guarded */
static void *no_collectives[COLL_REVOKE / sizeof(void *) + 1];

static int revoke_none(void *comm)
{
    (void)comm;
    return 0;
}

static bool guarded_revoke(void *comm, bool coll_only)
{
    void **c_coll = (void **)((char *)comm + C_COLL);
    if (*c_coll != NULL)
        return real_revoke(comm, coll_only);
    *c_coll = no_collectives;       /* none selected yet: none to revoke */
    bool revoked = real_revoke(comm, coll_only);
    *c_coll = NULL;
    return revoked;
}

#if defined(__x86_64__)
struct found {
    void **entry;
    uintptr_t relro_start, relro_end;
};

static uintptr_t address(uintptr_t base, ElfW(Addr) p)
{
    return p >= base ? p : base + p;    /* (glibc relocates these entries of the dynamic section in place) */
}

static int find_entry(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct found *f = data;
    const ElfW(Dyn) *dyn = NULL;
    if (strstr(info->dlpi_name, "/libmpi.so") == NULL)
        return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + ph->p_vaddr);
        if (ph->p_type == PT_GNU_RELRO) {
            f->relro_start = info->dlpi_addr + ph->p_vaddr;
            f->relro_end = f->relro_start + ph->p_memsz;
        }
    }
    const ElfW(Rela) *rela = NULL;
    const ElfW(Sym) *sym = NULL;
    const char *str = NULL;
    size_t bytes = 0;
    for (; dyn != NULL && dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_JMPREL)
            rela = (const ElfW(Rela) *)address(info->dlpi_addr, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_PLTRELSZ)
            bytes = dyn->d_un.d_val;
        else if (dyn->d_tag == DT_SYMTAB)
            sym = (const ElfW(Sym) *)address(info->dlpi_addr, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_STRTAB)
            str = (const char *)address(info->dlpi_addr, dyn->d_un.d_ptr);
    }
    if (rela == NULL || sym == NULL || str == NULL)
        return 0;
    for (size_t i = 0; i < bytes / sizeof *rela; i++) {
        if (strcmp(str + sym[ELF64_R_SYM(rela[i].r_info)].st_name, "ompi_comm_revoke_local") == 0) {
            f->entry = (void **)(info->dlpi_addr + rela[i].r_offset);
            return 1;
        }
    }
    return 0;
}
#endif

int ftc_guard_revoke(void)
{
    if (entry != NULL)
        return 1;
#if defined(__x86_64__)
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    void *real = dlsym(RTLD_DEFAULT, "ompi_comm_revoke_local");
    if (strncmp(version, "Open MPI v5.0.", 14) != 0 || real == NULL ||
        memcmp((const unsigned char *)real + KNOWN_AT, KNOWN, sizeof KNOWN) != 0)
        return 0;
    struct found f = {NULL, 0, 0};
    dl_iterate_phdr(find_entry, &f);
    if (f.entry == NULL)
        return -1;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    void *start = (void *)((uintptr_t)f.entry & ~(page - 1));
    if (mprotect(start, page, PROT_READ | PROT_WRITE) != 0)
        return -1;
    real_revoke = (revoke_fn)real;
    no_collectives[COLL_REVOKE / sizeof(void *)] = (void *)revoke_none;
    __atomic_store_n(f.entry, (void *)guarded_revoke, __ATOMIC_SEQ_CST);
    if ((uintptr_t)f.entry >= f.relro_start && (uintptr_t)f.entry < f.relro_end)
        mprotect(start, page, PROT_READ);       /* (bound at load: read-only again) */
    entry = f.entry;
    return 1;
#else
    return 0;
#endif
}

int ftc_guard_selftest(void)
{
    MPI_Comm dup;
    int revoked = 0;
    revoke_fn call = entry != NULL ? (revoke_fn)*entry : (revoke_fn)dlsym(RTLD_DEFAULT, "ompi_comm_revoke_local");
    if (call == NULL || MPI_Comm_dup(MPI_COMM_SELF, &dup) != MPI_SUCCESS)
        return -1;
    void **c_coll = (void **)((char *)dup + C_COLL);   /* (Open MPI's handle is the object) */
    void *selected = *c_coll;
    *c_coll = NULL;                 /* as before ompi_comm_activate selects its collectives */
    call(dup, false);               /* what a failure reported meanwhile runs (ompi_comm_set_rank_failed) */
    *c_coll = selected;
    MPIX_Comm_is_revoked(dup, &revoked);
    MPI_Comm_free(&dup);
    return revoked;
}
