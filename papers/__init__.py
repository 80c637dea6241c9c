"""One module per paper's readers and drivers, above eval.py and below commands/ and the method files: what a
method needs for its paper's data and experiments but a reader of its math does not.

  cclip_settings  C-CLIP's protocol as settings (torch-free): cclip.py's and the continual baselines' shared fields
  cclip_tasks     C-CLIP: the task list, evaluation sets, per-task learning rates, research merge schedule
  cmcl            DNS: frozen CLIP features, CMCL's feature readers, step plan, tables, the drivers
  erclip_data     ERCLIP: the COCO + ShareGPT4V training set from its public sources
  erclip_sweeps   ERCLIP Sec. 4.3-4.4 on real data (a sweep's run folders: plumbing/runfolder.py)
  longclip_data   Long-CLIP at ERCLIP's budget: training manifests, short captions, erclip.py's results
  m2mix_data      m2-Mix: the Flickr30k / COCO training manifests from Karpathy's split files, m2mix.py's choice
                  of training manifest and test protocols (commands.vlcl reads Karpathy's images too)
  mosei           m2-Mix Sec. 5.5 / GMC: the CMU-MOSEI reader (gmc.py --convert writes its .npz copy)
  zscl_mtil       ZSCL's MTIL as the continual drivers report it (Transfer / Average / Last), dns.py's features of
                  a classification test set
"""
